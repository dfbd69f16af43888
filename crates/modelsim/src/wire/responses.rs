//! OpenAI Responses: `output` items (`message` with `output_text`, `function_call`), or the
//! `response.created` … `response.completed` event stream.

use super::{Answer, Request, count_runs, estimate_tokens, output_tokens, pieces};
use crate::script::{OfferedTool, Resolved};
use serde_json::{Value, json};

/// Input items the model itself produced in earlier turns.
fn is_assistant_item(item: &Value) -> bool {
    match item["type"].as_str() {
        Some("function_call" | "custom_tool_call" | "local_shell_call" | "reasoning") => true,
        Some("message") | None => item["role"] == "assistant",
        _ => false,
    }
}

/// Reads what the answer depends on from a request body.
pub(crate) fn parse(body: &Value, len: usize) -> Request {
    let tools = body["tools"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|t| Some(OfferedTool::new(t["name"].as_str()?, &t["parameters"])))
                .collect()
        })
        .unwrap_or_default();
    let input = body["input"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    Request {
        tools,
        assistant_turns: count_runs(input, is_assistant_item),
        stream: body["stream"].as_bool().unwrap_or(false),
        model: body["model"].as_str().unwrap_or("modelsim").to_string(),
        include_usage: false,
        input_tokens: estimate_tokens(len),
    }
}

/// Writes the answer, as the API would for `req.stream`.
pub(crate) fn render(req: &Request, r: &Resolved, seq: u64, created: i64) -> Answer {
    let id = format!("resp_modelsim_{seq}");
    let out = output_tokens(r.text.as_deref(), &r.calls);
    let usage = json!({
        "input_tokens": req.input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": req.input_tokens + out,
    });
    let mut items = Vec::new();
    if let Some(text) = &r.text {
        items.push(json!({
            "type": "message", "id": format!("msg_{seq}"), "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }));
    }
    for c in &r.calls {
        items.push(json!({
            "type": "function_call", "id": format!("fc_{}", c.id), "status": "completed",
            "call_id": c.id, "name": c.name, "arguments": c.arguments.to_string(),
        }));
    }
    let response = |status: &str, output: Vec<Value>, usage: Value| {
        json!({
            "id": id, "object": "response", "created_at": created, "status": status,
            "model": req.model, "output": output, "usage": usage,
        })
    };
    if !req.stream {
        return Answer::Json(response("completed", items, usage));
    }
    let mut n = 0u64;
    let mut events: Vec<(Option<&'static str>, String)> = Vec::new();
    let mut push = |events: &mut Vec<_>, name: &'static str, mut data: Value| {
        data["type"] = json!(name);
        data["sequence_number"] = json!(n);
        n += 1;
        events.push((Some(name), data.to_string()));
    };
    push(
        &mut events,
        "response.created",
        json!({"response": response("in_progress", vec![], Value::Null)}),
    );
    push(
        &mut events,
        "response.in_progress",
        json!({"response": response("in_progress", vec![], Value::Null)}),
    );
    for (i, item) in items.iter().enumerate() {
        let item_id = item["id"].clone();
        let mut head = item.clone();
        head["status"] = json!("in_progress");
        if item["type"] == "message" {
            head["content"] = json!([]);
            push(
                &mut events,
                "response.output_item.added",
                json!({"output_index": i, "item": head}),
            );
            let part = json!({"type": "output_text", "text": "", "annotations": []});
            push(
                &mut events,
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": i, "content_index": 0, "part": part}),
            );
            let text = item["content"][0]["text"].as_str().unwrap_or_default();
            for p in pieces(text, 3) {
                push(
                    &mut events,
                    "response.output_text.delta",
                    json!({"item_id": item_id, "output_index": i, "content_index": 0, "delta": p}),
                );
            }
            push(
                &mut events,
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": i, "content_index": 0, "text": text}),
            );
            push(
                &mut events,
                "response.content_part.done",
                json!({"item_id": item_id, "output_index": i, "content_index": 0, "part": item["content"][0]}),
            );
        } else {
            head["arguments"] = json!("");
            push(
                &mut events,
                "response.output_item.added",
                json!({"output_index": i, "item": head}),
            );
            let args = item["arguments"].as_str().unwrap_or_default();
            for p in pieces(args, 3) {
                push(
                    &mut events,
                    "response.function_call_arguments.delta",
                    json!({"item_id": item_id, "output_index": i, "delta": p}),
                );
            }
            push(
                &mut events,
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": i, "arguments": args}),
            );
        }
        push(
            &mut events,
            "response.output_item.done",
            json!({"output_index": i, "item": item}),
        );
    }
    push(
        &mut events,
        "response.completed",
        json!({"response": response("completed", items, usage)}),
    );
    Answer::Sse(events)
}
