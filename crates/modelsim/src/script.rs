//! What the model answers, turn by turn.
//!
//! The turn a request gets is read from the request itself: it is the number of assistant
//! turns already in its conversation. A harness that retries a request, sends side requests
//! or continues an earlier session therefore still lands on the right turn, and a script for
//! a `continue` run simply lists the turns of both runs one after the other.

use crate::ModelSimError;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// The whole conversation a test wants: the answer to each turn, in order.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Script {
    /// Answer `n` goes to a request whose conversation holds `n` assistant turns.
    #[serde(default)]
    pub turns: Vec<Turn>,
    /// The text for requests that offer no tools (titles, summaries, quota probes), which
    /// are not part of the scripted conversation; `"ok"` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub side_text: Option<String>,
    /// The model id reported by `GET /v1/models`; `"modelsim"` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// One assistant turn: some text, some tool calls, or both, optionally late.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    /// Text before the tool calls (or the final answer when there are none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Tool calls, answered in this order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// How long to wait before answering, so a test can cancel while the model "thinks".
    #[serde(default, skip_serializing_if = "is_zero")]
    pub delay_ms: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A tool call given as alternatives: the first that fits a tool the request offers is
/// sent, so one script serves harnesses whose tools have other names and arguments (pi's
/// `write` takes `path`, Claude Code's `Write` takes `file_path`, opencode's `write`
/// `filePath`). An alternative fits a tool of its name whose parameter schema names every
/// one of its argument keys (or lists no properties at all).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(from = "ToolCallRepr", into = "ToolCallRepr")]
pub struct ToolCall {
    /// The alternatives, most preferred first; never empty when built through this crate.
    pub any_of: Vec<ToolChoice>,
}

/// One concrete tool call: a tool name and its JSON arguments.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ToolChoice {
    /// The tool's name as the harness offers it.
    pub name: String,
    /// The arguments object.
    #[serde(default = "empty_object")]
    pub arguments: Value,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// A script file may write a tool call as one `{name, arguments}` or as `{any_of: [...]}`.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum ToolCallRepr {
    AnyOf { any_of: Vec<ToolChoice> },
    One(ToolChoice),
}

impl From<ToolCallRepr> for ToolCall {
    fn from(r: ToolCallRepr) -> Self {
        match r {
            ToolCallRepr::AnyOf { any_of } => ToolCall { any_of },
            ToolCallRepr::One(c) => ToolCall { any_of: vec![c] },
        }
    }
}

impl From<ToolCall> for ToolCallRepr {
    fn from(c: ToolCall) -> Self {
        ToolCallRepr::AnyOf { any_of: c.any_of }
    }
}

impl Script {
    /// An empty script; add turns with [`Script::turn`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a turn.
    pub fn turn(mut self, turn: Turn) -> Self {
        self.turns.push(turn);
        self
    }

    /// Sets the text side requests get.
    pub fn side_text(mut self, text: impl Into<String>) -> Self {
        self.side_text = Some(text.into());
        self
    }

    /// Reads a script from a JSON file.
    pub fn from_file(path: &Path) -> Result<Self, ModelSimError> {
        let raw = std::fs::read(path).map_err(|source| ModelSimError::ReadScript {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_slice(&raw).map_err(|source| ModelSimError::ParseScript {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Decides the answer to a request whose conversation holds `assistant_turns` assistant
    /// turns and which offers `tools`; `seq` (the request's number) keeps call ids unique.
    pub(crate) fn resolve(
        &self,
        assistant_turns: usize,
        tools: &[OfferedTool],
        seq: u64,
    ) -> Resolved {
        if tools.is_empty() {
            return Resolved {
                turn: None,
                side: true,
                delay: Duration::ZERO,
                text: Some(self.side_text.clone().unwrap_or_else(|| "ok".into())),
                calls: Vec::new(),
                note: None,
            };
        }
        let Some(turn) = self.turns.get(assistant_turns) else {
            let note = format!(
                "modelsim: the script has {} turns and this request is turn {}",
                self.turns.len(),
                assistant_turns
            );
            return Resolved::failure(None, note);
        };
        let mut calls = Vec::with_capacity(turn.tool_calls.len());
        for (i, call) in turn.tool_calls.iter().enumerate() {
            let Some(choice) = call.any_of.iter().find(|c| tools.iter().any(|t| t.fits(c))) else {
                let wanted: Vec<&str> = call.any_of.iter().map(|c| c.name.as_str()).collect();
                let offered: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
                let note = format!(
                    "modelsim: turn {assistant_turns} wants one of the tools {wanted:?} (with their arguments) but the request offers {offered:?}"
                );
                return Resolved::failure(Some(assistant_turns), note);
            };
            calls.push(ResolvedCall {
                id: format!("call_{seq}_{i}"),
                name: choice.name.clone(),
                arguments: choice.arguments.clone(),
            });
        }
        Resolved {
            turn: Some(assistant_turns),
            side: false,
            delay: Duration::from_millis(turn.delay_ms),
            text: turn.text.clone(),
            calls,
            note: None,
        }
    }
}

impl Turn {
    /// A turn that answers with text only.
    pub fn text(text: impl Into<String>) -> Self {
        Turn {
            text: Some(text.into()),
            ..Turn::default()
        }
    }

    /// A turn that makes one tool call.
    pub fn tool(call: ToolCall) -> Self {
        Turn {
            tool_calls: vec![call],
            ..Turn::default()
        }
    }

    /// Adds a tool call after the ones already there.
    pub fn and_tool(mut self, call: ToolCall) -> Self {
        self.tool_calls.push(call);
        self
    }

    /// Sets the text said before the tool calls.
    pub fn with_text(mut self, text: impl Into<String>) -> Self {
        self.text = Some(text.into());
        self
    }

    /// Answers this turn only after `delay`.
    pub fn delayed(mut self, delay: Duration) -> Self {
        self.delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self
    }
}

impl ToolCall {
    /// A call of tool `name` with `arguments`.
    pub fn new(name: impl Into<String>, arguments: Value) -> Self {
        ToolCall {
            any_of: vec![ToolChoice {
                name: name.into(),
                arguments,
            }],
        }
    }

    /// Adds an alternative, used when the request does not offer the earlier ones.
    pub fn or(mut self, name: impl Into<String>, arguments: Value) -> Self {
        self.any_of.push(ToolChoice {
            name: name.into(),
            arguments,
        });
        self
    }
}

/// A tool as a request offers it: its name and the properties its parameter schema lists.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OfferedTool {
    pub name: String,
    /// `None` when the schema lists no properties (then any arguments fit).
    pub params: Option<Vec<String>>,
}

impl OfferedTool {
    /// Reads a tool's name and its schema's property names.
    pub(crate) fn new(name: &str, schema: &Value) -> Self {
        OfferedTool {
            name: name.to_string(),
            params: schema["properties"]
                .as_object()
                .map(|p| p.keys().cloned().collect()),
        }
    }

    fn fits(&self, choice: &ToolChoice) -> bool {
        if self.name != choice.name {
            return false;
        }
        match (&self.params, choice.arguments.as_object()) {
            (Some(params), Some(args)) => args.keys().all(|k| params.contains(k)),
            _ => true,
        }
    }
}

/// The answer decided for one request.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    /// The script turn answered, `None` for side requests and for turns past the script.
    pub turn: Option<usize>,
    /// Whether the request offered no tools.
    pub side: bool,
    pub delay: Duration,
    pub text: Option<String>,
    pub calls: Vec<ResolvedCall>,
    /// Why the answer is not the scripted one, also sent as the text so the harness shows it.
    pub note: Option<String>,
}

impl Resolved {
    fn failure(turn: Option<usize>, note: String) -> Self {
        Resolved {
            turn,
            side: false,
            delay: Duration::ZERO,
            text: Some(note.clone()),
            calls: Vec::new(),
            note: Some(note),
        }
    }
}

/// A tool call with the name picked and its id given.
#[derive(Debug, Clone)]
pub(crate) struct ResolvedCall {
    pub id: String,
    pub name: String,
    pub arguments: Value,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools(names: &[&str]) -> Vec<OfferedTool> {
        names
            .iter()
            .map(|s| OfferedTool::new(s, &Value::Null))
            .collect()
    }

    #[test]
    fn a_script_file_may_write_a_call_plainly_or_as_alternatives() {
        let s: Script = serde_json::from_value(json!({
            "turns": [
                {"tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]},
                {"tool_calls": [{"any_of": [
                    {"name": "write", "arguments": {"path": "a"}},
                    {"name": "Write", "arguments": {"file_path": "/a"}}
                ]}], "delay_ms": 5},
                {"text": "done"}
            ]
        }))
        .unwrap();
        let built = Script::new()
            .turn(Turn::tool(ToolCall::new("bash", json!({"command": "ls"}))))
            .turn(
                Turn::tool(
                    ToolCall::new("write", json!({"path": "a"}))
                        .or("Write", json!({"file_path": "/a"})),
                )
                .delayed(Duration::from_millis(5)),
            )
            .turn(Turn::text("done"));
        assert_eq!(s, built);
        // What a builder writes reads back as the same script.
        let again: Script = serde_json::from_str(&serde_json::to_string(&built).unwrap()).unwrap();
        assert_eq!(again, built);
        assert!(serde_json::from_value::<Script>(json!({"turns": [{"txt": "x"}]})).is_err());
    }

    #[test]
    fn the_turn_follows_the_conversation_and_the_offered_tools_pick_the_name() {
        let s = Script::new()
            .turn(Turn::tool(
                ToolCall::new("write", json!({"path": "a"}))
                    .or("Write", json!({"file_path": "/a"})),
            ))
            .turn(Turn::text("done").delayed(Duration::from_millis(7)));
        let r = s.resolve(0, &tools(&["Bash", "Write"]), 3);
        assert_eq!(r.turn, Some(0));
        assert_eq!(r.calls.len(), 1);
        assert_eq!(r.calls[0].name, "Write");
        assert_eq!(r.calls[0].arguments, json!({"file_path": "/a"}));
        assert_eq!(r.calls[0].id, "call_3_0");
        let r = s.resolve(0, &tools(&["write", "Write"]), 4);
        assert_eq!(r.calls[0].name, "write");
        let r = s.resolve(1, &tools(&["write"]), 5);
        assert_eq!((r.turn, r.text.as_deref()), (Some(1), Some("done")));
        assert_eq!(r.delay, Duration::from_millis(7));
        assert!(r.calls.is_empty());
    }

    #[test]
    fn the_parameter_schema_tells_tools_of_one_name_apart() {
        let s = Script::new().turn(Turn::tool(
            ToolCall::new("write", json!({"path": "a", "content": "x"}))
                .or("write", json!({"filePath": "a", "content": "x"})),
        ));
        let schema = |keys: &[&str]| {
            let props: serde_json::Map<String, Value> =
                keys.iter().map(|k| (k.to_string(), json!({}))).collect();
            json!({"type": "object", "properties": props})
        };
        let pi = [OfferedTool::new("write", &schema(&["path", "content"]))];
        let opencode = [OfferedTool::new("write", &schema(&["filePath", "content"]))];
        assert_eq!(s.resolve(0, &pi, 1).calls[0].arguments["path"], "a");
        assert_eq!(
            s.resolve(0, &opencode, 1).calls[0].arguments["filePath"],
            "a"
        );
        let neither = [OfferedTool::new("write", &schema(&["file", "content"]))];
        assert!(s.resolve(0, &neither, 1).calls.is_empty());
    }

    #[test]
    fn side_requests_missing_tools_and_exhausted_scripts_are_told_apart() {
        let s = Script::new()
            .turn(Turn::tool(ToolCall::new("write", json!({}))))
            .side_text("a title");
        let side = s.resolve(0, &[], 1);
        assert!(side.side);
        assert_eq!((side.turn, side.text.as_deref()), (None, Some("a title")));
        let missing = s.resolve(0, &tools(&["bash"]), 2);
        assert!(!missing.side && missing.calls.is_empty());
        assert!(missing.note.as_deref().unwrap().contains("[\"write\"]"));
        let past = s.resolve(1, &tools(&["write"]), 3);
        assert_eq!(past.turn, None);
        assert!(past.note.as_deref().unwrap().contains("has 1 turns"));
    }
}
