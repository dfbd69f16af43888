//! The run event envelope: a kind and a JSON payload, `{"kind": "...", "payload": {...}}`.
//!
//! Kinds and payload fields are a stable wire form: clients parse them, the store keeps
//! them. A field is never renamed or given another type; new optional fields and new
//! kinds may appear, so readers ignore what they do not know. The payload of each kind is
//! the matching `*Payload` struct (or [`Usage`]); [`Event`]'s constructors build them.
//!
//! `truncated` and `end` events are written by the store (see `sandpit-store`), as are
//! `approval_requested` and `approval_decided`, whose payload is the approval record.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// What an event reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A piece of the assistant's answer as it streams: [`TextPayload`].
    MessageDelta,
    /// A complete message: [`MessagePayload`].
    Message,
    /// A piece (or all) of the model's visible reasoning: [`TextPayload`].
    ReasoningDelta,
    /// The agent calls a tool: [`ToolCallPayload`].
    ToolCall,
    /// A tool's result: [`ToolResultPayload`].
    ToolResult,
    /// The agent changed a file: [`FileChangePayload`].
    FileChange,
    /// Tokens and cost: [`Usage`].
    Usage,
    /// Something went wrong (the run may go on): [`ErrorPayload`].
    Error,
    /// A change of the harness's or the run's status: [`StatusPayload`].
    Status,
    /// A person's approval was asked for (written by the store).
    ApprovalRequested,
    /// An approval was decided or expired (written by the store).
    ApprovalDecided,
    /// The run reached its event cap; later events were dropped (written by the store).
    Truncated,
    /// The run finished: `{"state": ..., "reason": ...}`; always its last event (written by
    /// the store).
    End,
}

impl EventKind {
    /// Every kind.
    pub const ALL: [EventKind; 13] = [
        EventKind::MessageDelta,
        EventKind::Message,
        EventKind::ReasoningDelta,
        EventKind::ToolCall,
        EventKind::ToolResult,
        EventKind::FileChange,
        EventKind::Usage,
        EventKind::Error,
        EventKind::Status,
        EventKind::ApprovalRequested,
        EventKind::ApprovalDecided,
        EventKind::Truncated,
        EventKind::End,
    ];

    /// The name on the wire and in the store.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::MessageDelta => "message_delta",
            EventKind::Message => "message",
            EventKind::ReasoningDelta => "reasoning_delta",
            EventKind::ToolCall => "tool_call",
            EventKind::ToolResult => "tool_result",
            EventKind::FileChange => "file_change",
            EventKind::Usage => "usage",
            EventKind::Error => "error",
            EventKind::Status => "status",
            EventKind::ApprovalRequested => "approval_requested",
            EventKind::ApprovalDecided => "approval_decided",
            EventKind::Truncated => "truncated",
            EventKind::End => "end",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Returned when a string names no [`EventKind`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown event kind {0:?}")]
pub struct ParseEventKindError(pub String);

impl FromStr for EventKind {
    type Err = ParseEventKindError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EventKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| ParseEventKindError(s.to_string()))
    }
}

/// One event of a run, before it gets its sequence number in the store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// What it reports.
    pub kind: EventKind,
    /// The kind's payload (an object).
    #[serde(default)]
    pub payload: Value,
}

/// Payload of `message_delta` and `reasoning_delta`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextPayload {
    /// The text.
    pub text: String,
}

/// Payload of `message`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessagePayload {
    /// `assistant` (or `user`, `system`).
    pub role: String,
    /// The whole text.
    pub text: String,
}

/// Payload of `tool_call`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallPayload {
    /// The harness's id of the call, which its result names too.
    pub id: Option<String>,
    /// Tool name, as the harness calls it (`bash`, `Write`, `command_execution`, ...).
    pub name: String,
    /// The tool's arguments.
    pub input: Value,
}

/// Payload of `tool_result`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolResultPayload {
    /// The id of the call it answers.
    pub id: Option<String>,
    /// Tool name, when the harness says.
    pub name: Option<String>,
    /// The output as text.
    pub output: String,
    /// Whether the tool failed.
    pub is_error: bool,
}

/// How a file changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileChange {
    /// It is new.
    Created,
    /// It was written or edited.
    Modified,
    /// It was removed.
    Deleted,
}

/// Payload of `file_change`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileChangePayload {
    /// The file, as the harness named it.
    pub path: String,
    /// How it changed.
    pub change: FileChange,
}

/// Payload of `usage`: what the harness reported, each field only when it did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Input (prompt) tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    /// Output (completion) tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    /// Input tokens read from the provider's cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_tokens: Option<u64>,
    /// Input tokens written to the provider's cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
    /// Cost in US dollars, as the harness computed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
}

impl Usage {
    /// Whether nothing was reported.
    pub fn is_empty(&self) -> bool {
        *self == Usage::default()
    }
}

/// Payload of `error`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorPayload {
    /// What went wrong.
    pub message: String,
}

/// Payload of `status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusPayload {
    /// A short word: `started`, `busy`, `idle`, `retrying`, ...
    pub status: String,
    /// More, when there is any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl Event {
    /// An event of `kind` with this payload.
    pub fn new(kind: EventKind, payload: Value) -> Event {
        Event { kind, payload }
    }

    /// A streamed piece of the answer.
    pub fn message_delta(text: impl Into<String>) -> Event {
        Event::new(EventKind::MessageDelta, json!({ "text": text.into() }))
    }

    /// A complete message.
    pub fn message(role: impl Into<String>, text: impl Into<String>) -> Event {
        Event::new(
            EventKind::Message,
            json!({ "role": role.into(), "text": text.into() }),
        )
    }

    /// A piece of visible reasoning.
    pub fn reasoning_delta(text: impl Into<String>) -> Event {
        Event::new(EventKind::ReasoningDelta, json!({ "text": text.into() }))
    }

    /// A tool call.
    pub fn tool_call(id: Option<String>, name: impl Into<String>, input: Value) -> Event {
        Event::new(
            EventKind::ToolCall,
            json!({ "id": id, "name": name.into(), "input": input }),
        )
    }

    /// A tool's result.
    pub fn tool_result(
        id: Option<String>,
        name: Option<String>,
        output: impl Into<String>,
        is_error: bool,
    ) -> Event {
        Event::new(
            EventKind::ToolResult,
            json!({ "id": id, "name": name, "output": output.into(), "is_error": is_error }),
        )
    }

    /// A changed file.
    pub fn file_change(path: impl Into<String>, change: FileChange) -> Event {
        let change = match change {
            FileChange::Created => "created",
            FileChange::Modified => "modified",
            FileChange::Deleted => "deleted",
        };
        Event::new(
            EventKind::FileChange,
            json!({ "path": path.into(), "change": change }),
        )
    }

    /// Token use and cost.
    pub fn usage(usage: &Usage) -> Event {
        let mut payload = serde_json::Map::new();
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                payload.insert(k.to_string(), v);
            }
        };
        put("input_tokens", usage.input_tokens.map(Value::from));
        put("output_tokens", usage.output_tokens.map(Value::from));
        put(
            "cache_read_tokens",
            usage.cache_read_tokens.map(Value::from),
        );
        put(
            "cache_write_tokens",
            usage.cache_write_tokens.map(Value::from),
        );
        put("cost_usd", usage.cost_usd.map(Value::from));
        Event::new(EventKind::Usage, Value::Object(payload))
    }

    /// An error.
    pub fn error(message: impl Into<String>) -> Event {
        Event::new(EventKind::Error, json!({ "message": message.into() }))
    }

    /// A status change.
    pub fn status(status: impl Into<String>, detail: Option<String>) -> Event {
        let mut payload = json!({ "status": status.into() });
        if let (Some(detail), Some(map)) = (detail, payload.as_object_mut()) {
            map.insert("detail".into(), Value::String(detail));
        }
        Event::new(EventKind::Status, payload)
    }

    /// The payload read as `T`, when it has that shape.
    pub fn payload_as<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        T::deserialize(&self.payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_their_names_and_serde() {
        for kind in EventKind::ALL {
            assert_eq!(kind.as_str().parse::<EventKind>().unwrap(), kind);
            assert_eq!(
                serde_json::to_value(kind).unwrap(),
                Value::String(kind.as_str().into())
            );
        }
        assert!("nope".parse::<EventKind>().is_err());
    }

    #[test]
    fn the_envelope_has_a_stable_json_form() {
        let e = Event::tool_call(Some("c1".into()), "bash", json!({"command": "ls"}));
        assert_eq!(
            serde_json::to_value(&e).unwrap(),
            json!({"kind": "tool_call", "payload": {"id": "c1", "name": "bash", "input": {"command": "ls"}}})
        );
        let back: Event =
            serde_json::from_str(r#"{"kind":"message_delta","payload":{"text":"hi"},"extra":1}"#)
                .unwrap();
        assert_eq!(back, Event::message_delta("hi"));
        assert_eq!(
            serde_json::to_value(Event::status("busy", None)).unwrap(),
            json!({"kind": "status", "payload": {"status": "busy"}})
        );
    }

    #[test]
    fn constructors_build_the_documented_payloads() {
        let t: TextPayload = Event::message_delta("a").payload_as().unwrap();
        assert_eq!(t.text, "a");
        let t: TextPayload = Event::reasoning_delta("r").payload_as().unwrap();
        assert_eq!(t.text, "r");
        let m: MessagePayload = Event::message("assistant", "done").payload_as().unwrap();
        assert_eq!((m.role.as_str(), m.text.as_str()), ("assistant", "done"));
        let c: ToolCallPayload = Event::tool_call(None, "Write", json!({"file_path": "/a"}))
            .payload_as()
            .unwrap();
        assert_eq!((c.id, c.name.as_str()), (None, "Write"));
        let r: ToolResultPayload = Event::tool_result(Some("1".into()), None, "out", true)
            .payload_as()
            .unwrap();
        assert_eq!(
            r,
            ToolResultPayload {
                id: Some("1".into()),
                name: None,
                output: "out".into(),
                is_error: true
            }
        );
        for change in [
            FileChange::Created,
            FileChange::Modified,
            FileChange::Deleted,
        ] {
            let f: FileChangePayload = Event::file_change("/w/a.txt", change).payload_as().unwrap();
            assert_eq!(f.change, change);
        }
        let usage = Usage {
            input_tokens: Some(10),
            output_tokens: Some(2),
            cache_read_tokens: None,
            cache_write_tokens: Some(1),
            cost_usd: Some(0.5),
        };
        let e = Event::usage(&usage);
        assert_eq!(
            e.payload,
            json!({"input_tokens": 10, "output_tokens": 2, "cache_write_tokens": 1, "cost_usd": 0.5})
        );
        assert_eq!(e.payload_as::<Usage>().unwrap(), usage);
        let err: ErrorPayload = Event::error("boom").payload_as().unwrap();
        assert_eq!(err.message, "boom");
        let s: StatusPayload = Event::status("retrying", Some("429".into()))
            .payload_as()
            .unwrap();
        assert_eq!(s.detail.as_deref(), Some("429"));
    }
}
