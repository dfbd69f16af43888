//! OpenAI Chat Completions: `choices[0].message` or `choices[0].delta` chunks, then `[DONE]`.

use super::{Answer, Request, count_runs, estimate_tokens, output_tokens, pieces};
use crate::script::{OfferedTool, Resolved};
use serde_json::{Value, json};

/// Reads what the answer depends on from a request body.
pub(crate) fn parse(body: &Value, len: usize) -> Request {
    let tools = body["tools"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|t| {
                    // Chat Completions nests the tool in `function`; some clients do not.
                    let f = if t["function"].is_object() {
                        &t["function"]
                    } else {
                        t
                    };
                    Some(OfferedTool::new(f["name"].as_str()?, &f["parameters"]))
                })
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
        include_usage: body["stream_options"]["include_usage"]
            .as_bool()
            .unwrap_or(false),
        input_tokens: estimate_tokens(len),
    }
}

fn usage(req: &Request, r: &Resolved) -> Value {
    let out = output_tokens(r.text.as_deref(), &r.calls);
    json!({
        "prompt_tokens": req.input_tokens,
        "completion_tokens": out,
        "total_tokens": req.input_tokens + out,
    })
}

fn finish_reason(r: &Resolved) -> &'static str {
    if r.calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    }
}

/// Writes the answer, as the API would for `req.stream`.
pub(crate) fn render(req: &Request, r: &Resolved, seq: u64, created: i64) -> Answer {
    let id = format!("chatcmpl-{seq}");
    if !req.stream {
        let mut message = json!({"role": "assistant", "content": r.text});
        if !r.calls.is_empty() {
            message["tool_calls"] = r
                .calls
                .iter()
                .map(|c| {
                    json!({
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments.to_string()},
                    })
                })
                .collect();
        }
        return Answer::Json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(r)}],
            "usage": usage(req, r),
        }));
    }
    let chunk = |delta: Value, finish: Option<&str>| {
        json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
        .to_string()
    };
    let mut events = vec![(
        None,
        chunk(json!({"role": "assistant", "content": ""}), None),
    )];
    if let Some(text) = &r.text {
        for p in pieces(text, 3) {
            events.push((None, chunk(json!({"content": p}), None)));
        }
    }
    for (i, c) in r.calls.iter().enumerate() {
        let head = json!({"tool_calls": [{
            "index": i, "id": c.id, "type": "function",
            "function": {"name": c.name, "arguments": ""},
        }]});
        events.push((None, chunk(head, None)));
        for p in pieces(&c.arguments.to_string(), 3) {
            let delta = json!({"tool_calls": [{"index": i, "function": {"arguments": p}}]});
            events.push((None, chunk(delta, None)));
        }
    }
    events.push((None, chunk(json!({}), Some(finish_reason(r)))));
    if req.include_usage {
        let last = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "choices": [],
            "usage": usage(req, r),
        });
        events.push((None, last.to_string()));
    }
    events.push((None, "[DONE]".to_string()));
    Answer::Sse(events)
}
