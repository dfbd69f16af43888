//! Anthropic Messages: content blocks (`text`, `tool_use`) in one message, or the
//! `message_start` … `message_stop` event stream with `input_json_delta` for tool input.

use super::{Answer, Request, count_runs, estimate_tokens, output_tokens, pieces};
use crate::script::{OfferedTool, Resolved};
use serde_json::{Value, json};

/// Reads what the answer depends on from a request body.
pub(crate) fn parse(body: &Value, len: usize) -> Request {
    let tools = body["tools"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|t| Some(OfferedTool::new(t["name"].as_str()?, &t["input_schema"])))
                .collect()
        })
        .unwrap_or_default();
    let messages = body["messages"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    Request {
        tools,
        assistant_turns: count_runs(messages, |m| m["role"] == "assistant"),
        stream: body["stream"].as_bool().unwrap_or(false),
        model: body["model"].as_str().unwrap_or("modelsim").to_string(),
        include_usage: false,
        input_tokens: estimate_tokens(len),
    }
}

/// The answer to `count_tokens`.
pub(crate) fn count_tokens(len: usize) -> Value {
    json!({"input_tokens": estimate_tokens(len)})
}

fn stop_reason(r: &Resolved) -> &'static str {
    if r.calls.is_empty() {
        "end_turn"
    } else {
        "tool_use"
    }
}

/// Writes the answer, as the API would for `req.stream`.
pub(crate) fn render(req: &Request, r: &Resolved, seq: u64) -> Answer {
    let id = format!("msg_modelsim_{seq}");
    let out = output_tokens(r.text.as_deref(), &r.calls);
    if !req.stream {
        let mut content = Vec::new();
        if let Some(text) = &r.text {
            content.push(json!({"type": "text", "text": text}));
        }
        for c in &r.calls {
            content.push(
                json!({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}),
            );
        }
        return Answer::Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": content,
            "stop_reason": stop_reason(r),
            "stop_sequence": null,
            "usage": {"input_tokens": req.input_tokens, "output_tokens": out},
        }));
    }
    let start = json!({
        "type": "message_start",
        "message": {
            "id": id, "type": "message", "role": "assistant", "model": req.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": req.input_tokens, "output_tokens": 1},
        },
    });
    let mut events = vec![
        (Some("message_start"), start.to_string()),
        (Some("ping"), json!({"type": "ping"}).to_string()),
    ];
    let mut index = 0;
    let mut block = |events: &mut Vec<_>, head: Value, deltas: Vec<Value>| {
        let s = json!({"type": "content_block_start", "index": index, "content_block": head});
        events.push((Some("content_block_start"), s.to_string()));
        for d in deltas {
            let d = json!({"type": "content_block_delta", "index": index, "delta": d});
            events.push((Some("content_block_delta"), d.to_string()));
        }
        let stop = json!({"type": "content_block_stop", "index": index});
        events.push((Some("content_block_stop"), stop.to_string()));
        index += 1;
    };
    if let Some(text) = &r.text {
        let deltas = pieces(text, 3)
            .into_iter()
            .map(|p| json!({"type": "text_delta", "text": p}))
            .collect();
        block(&mut events, json!({"type": "text", "text": ""}), deltas);
    }
    for c in &r.calls {
        let head = json!({"type": "tool_use", "id": c.id, "name": c.name, "input": {}});
        let deltas = pieces(&c.arguments.to_string(), 3)
            .into_iter()
            .map(|p| json!({"type": "input_json_delta", "partial_json": p}))
            .collect();
        block(&mut events, head, deltas);
    }
    let delta = json!({
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason(r), "stop_sequence": null},
        "usage": {"output_tokens": out},
    });
    events.push((Some("message_delta"), delta.to_string()));
    events.push((
        Some("message_stop"),
        json!({"type": "message_stop"}).to_string(),
    ));
    Answer::Sse(events)
}
