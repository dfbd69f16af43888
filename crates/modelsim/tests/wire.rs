//! The model server driven by a plain HTTP client, for each wire API, streaming and not.

use sandpit_modelsim::{Api, Config, ModelServer, Script, ToolCall, Turn};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

fn script() -> Script {
    Script::new()
        .turn(
            Turn::tool(
                ToolCall::new("write", json!({"path": "hello.txt", "content": "hi\n"})).or(
                    "Write",
                    json!({"file_path": "/w/hello.txt", "content": "hi\n"}),
                ),
            )
            .with_text("Writing the file."),
        )
        .turn(Turn::tool(
            ToolCall::new("bash", json!({"command": "ls"}))
                .or("Bash", json!({"command": "ls", "description": "List"})),
        ))
        .turn(Turn::text("all done, the file is there"))
        .side_text("A title")
}

async fn start(script: Script) -> ModelServer {
    ModelServer::start(Config::new("127.0.0.1:0".parse().unwrap(), script))
        .await
        .unwrap()
}

/// One server-sent event: its `event:` name and its `data:` parsed (or as a string).
#[derive(Debug)]
struct Event {
    name: Option<String>,
    data: Value,
}

fn parse_sse(text: &str) -> Vec<Event> {
    text.split("\n\n")
        .filter(|b| !b.trim().is_empty())
        .map(|block| {
            let mut name = None;
            let mut data = String::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    name = Some(v.to_string());
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data.push_str(v);
                }
            }
            let data = serde_json::from_str(&data).unwrap_or(Value::String(data));
            Event { name, data }
        })
        .collect()
}

fn chat_tools(names: &[(&str, &[&str])]) -> Value {
    names
        .iter()
        .map(|(name, props)| {
            let props: serde_json::Map<String, Value> =
                props.iter().map(|p| (p.to_string(), json!({}))).collect();
            json!({"type": "function", "function": {"name": name,
                "parameters": {"type": "object", "properties": props}}})
        })
        .collect()
}

const PI_TOOLS: &[(&str, &[&str])] = &[
    ("read", &["path"]),
    ("bash", &["command", "timeout"]),
    ("write", &["path", "content"]),
];

#[tokio::test]
async fn chat_completions_answers_tool_calls_and_text_without_streaming() {
    let server = start(script()).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", server.base_url());
    let mut messages = vec![json!({"role": "user", "content": "make hello.txt"})];
    let res: Value = client
        .post(&url)
        .bearer_auth("sk-test")
        .json(&json!({"model": "m", "messages": messages, "tools": chat_tools(PI_TOOLS)}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let choice = &res["choices"][0];
    assert_eq!(res["object"], "chat.completion");
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Writing the file.");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "write");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"path": "hello.txt", "content": "hi\n"}));
    assert!(res["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    // The conversation goes on: the answer and its tool result make the next request turn 1.
    messages.push(choice["message"].clone());
    messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "ok"}));
    let res: Value = client
        .post(&url)
        .bearer_auth("sk-test")
        .json(&json!({"model": "m", "messages": messages, "tools": chat_tools(PI_TOOLS)}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let call = &res["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "bash");
    assert_eq!(call["function"]["arguments"], r#"{"command":"ls"}"#);

    let reqs = server.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].api, Api::ChatCompletions);
    assert_eq!(reqs[0].api_key(), Some("sk-test"));
    assert_eq!(reqs[0].header("Authorization"), Some("Bearer sk-test"));
    assert_eq!((reqs[0].turn, reqs[1].turn), (Some(0), Some(1)));
    assert!(!reqs[0].stream);
    // What the client sent is kept whole, so a test can see the earlier turns in it.
    assert_eq!(reqs[1].body["messages"].as_array().unwrap().len(), 3);
    assert_eq!(
        reqs[1].body["messages"][1]["content"],
        json!("Writing the file.")
    );
}

#[tokio::test]
async fn chat_completions_streams_deltas_that_join_into_the_answer() {
    let server = start(script()).await;
    let res = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base_url()))
        .json(&json!({
            "model": "m", "stream": true, "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "go"}],
            "tools": chat_tools(PI_TOOLS),
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(
        res.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let events = parse_sse(&res.text().await.unwrap());
    assert_eq!(events.last().unwrap().data, json!("[DONE]"));
    let chunks: Vec<&Value> = events[..events.len() - 1].iter().map(|e| &e.data).collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    let mut text = String::new();
    let mut args = String::new();
    let mut name = None;
    let mut finish = None;
    for c in &chunks {
        let Some(choice) = c["choices"].get(0) else {
            continue;
        };
        text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if let Some(call) = choice["delta"]["tool_calls"].get(0) {
            assert_eq!(call["index"], 0);
            if let Some(n) = call["function"]["name"].as_str() {
                name = Some(n.to_string());
                assert_eq!(call["id"], "call_1_0");
            }
            args.push_str(call["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(text, "Writing the file.");
    assert_eq!(name.as_deref(), Some("write"));
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap(),
        json!({"path": "hello.txt", "content": "hi\n"})
    );
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    // Several deltas, not one chunk holding everything.
    assert!(chunks.len() >= 8, "{} chunks", chunks.len());
    // include_usage: a last chunk with no choices and the usage.
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert!(last["usage"]["total_tokens"].as_u64().unwrap() > 0);
    assert!(server.requests()[0].stream);
}

fn anthropic_tools() -> Value {
    json!([
        {"name": "Bash", "input_schema": {"type": "object", "properties": {"command": {}, "description": {}}}},
        {"name": "Write", "input_schema": {"type": "object", "properties": {"file_path": {}, "content": {}}}},
    ])
}

#[tokio::test]
async fn messages_answers_tool_use_blocks_without_streaming() {
    let server = start(script()).await;
    let res: Value = reqwest::Client::new()
        .post(format!("{}/v1/messages", server.base_url()))
        .header("x-api-key", "sk-ant-test")
        .header("anthropic-version", "2023-06-01")
        .json(
            &json!({"model": "m", "max_tokens": 100, "tools": anthropic_tools(),
                      "messages": [{"role": "user", "content": "go"}]}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(res["type"], "message");
    assert_eq!(res["stop_reason"], "tool_use");
    assert_eq!(
        res["content"][0],
        json!({"type": "text", "text": "Writing the file."})
    );
    assert_eq!(res["content"][1]["type"], "tool_use");
    assert_eq!(res["content"][1]["name"], "Write");
    assert_eq!(
        res["content"][1]["input"],
        json!({"file_path": "/w/hello.txt", "content": "hi\n"})
    );
    let req = &server.requests()[0];
    assert_eq!(req.api, Api::Messages);
    assert_eq!(req.api_key(), Some("sk-ant-test"));
    assert_eq!(req.header("anthropic-version"), Some("2023-06-01"));
}

#[tokio::test]
async fn messages_streams_the_event_sequence_with_input_json_deltas() {
    let server = start(script()).await;
    let client = reqwest::Client::new();
    // Claude Code's shape: `?beta=true`, and the earlier turn in the conversation.
    let body = json!({
        "model": "m", "max_tokens": 100, "stream": true, "tools": anthropic_tools(),
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Write", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
        ],
    });
    let text = client
        .post(format!("{}/v1/messages?beta=true", server.base_url()))
        .header("x-api-key", "k")
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = parse_sse(&text);
    let names: Vec<&str> = events.iter().map(|e| e.name.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    // Each event's data repeats its name as `type`, as the API does.
    for e in &events {
        assert_eq!(e.data["type"], json!(e.name.as_deref().unwrap()));
    }
    let start = &events[2].data["content_block"];
    assert_eq!(start["type"], "tool_use");
    assert_eq!(start["name"], "Bash");
    let partial: String = events
        .iter()
        .filter(|e| e.name.as_deref() == Some("content_block_delta"))
        .map(|e| {
            assert_eq!(e.data["delta"]["type"], "input_json_delta");
            e.data["delta"]["partial_json"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&partial).unwrap(),
        json!({"command": "ls", "description": "List"})
    );
    assert_eq!(events[7].data["delta"]["stop_reason"], "tool_use");
    let req = &server.requests()[0];
    assert_eq!(req.query.as_deref(), Some("beta=true"));
    assert_eq!(req.turn, Some(1));

    // The final turn streams a text block and ends the turn.
    let mut body = body;
    let msgs = body["messages"].as_array_mut().unwrap();
    msgs.push(json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "Bash", "input": {}}]}));
    msgs.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "x"}]}));
    let text = client
        .post(format!("{}/v1/messages?beta=true", server.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = parse_sse(&text);
    let said: String = events
        .iter()
        .filter_map(|e| e.data["delta"]["text"].as_str())
        .collect();
    assert_eq!(said, "all done, the file is there");
    let stop = events
        .iter()
        .find(|e| e.name.as_deref() == Some("message_delta"))
        .unwrap();
    assert_eq!(stop.data["delta"]["stop_reason"], "end_turn");
}

#[tokio::test]
async fn count_tokens_models_side_requests_and_unknown_paths() {
    let server = start(script()).await;
    let client = reqwest::Client::new();
    let base = server.base_url();
    let counted: Value = client
        .post(format!("{base}/v1/messages/count_tokens?beta=true"))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "a longer prompt here"}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(counted["input_tokens"].as_u64().unwrap() > 1);
    let models: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "modelsim");
    // No tools offered: a title request, answered with the side text and no turn used.
    let side: Value = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "title?"}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(side["choices"][0]["message"]["content"], "A title");
    let missing = client.get(format!("{base}/v2/other")).send().await.unwrap();
    assert_eq!(missing.status(), 404);
    let bad = client
        .post(format!("{base}/v1/messages"))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let reqs = server.requests();
    let apis: Vec<Api> = reqs.iter().map(|r| r.api).collect();
    assert_eq!(
        apis,
        [
            Api::CountTokens,
            Api::Models,
            Api::ChatCompletions,
            Api::Unknown,
            Api::Messages
        ]
    );
    assert!(reqs[2].side && reqs[2].turn.is_none());
    assert_eq!(reqs[3].status, 404);
    assert_eq!(reqs[4].body, json!("not json"));
    let seqs: Vec<u64> = reqs.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5]);
}

fn responses_tools() -> Value {
    json!([{"type": "function", "name": "exec_command",
            "parameters": {"type": "object", "properties": {"cmd": {}}}},
           {"type": "web_search"}])
}

#[tokio::test]
async fn responses_answers_function_calls_streaming_and_not() {
    let script = Script::new()
        .turn(Turn::tool(ToolCall::new(
            "exec_command",
            json!({"cmd": "ls"}),
        )))
        .turn(Turn::text("finished"));
    let server = start(script).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/responses", server.base_url());
    let mut input = vec![
        json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}),
    ];
    let res: Value = client
        .post(&url)
        .json(&json!({"model": "m", "input": input, "tools": responses_tools()}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(res["status"], "completed");
    let item = &res["output"][0];
    assert_eq!(item["type"], "function_call");
    assert_eq!(item["name"], "exec_command");
    assert_eq!(item["arguments"], r#"{"cmd":"ls"}"#);

    let text = client
        .post(&url)
        .json(&json!({"model": "m", "input": input, "tools": responses_tools(), "stream": true}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = parse_sse(&text);
    let names: Vec<&str> = events.iter().map(|e| e.name.as_deref().unwrap()).collect();
    assert_eq!(names.first(), Some(&"response.created"));
    assert_eq!(names.last(), Some(&"response.completed"));
    let args: String = events
        .iter()
        .filter(|e| e.name.as_deref() == Some("response.function_call_arguments.delta"))
        .map(|e| e.data["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(args, r#"{"cmd":"ls"}"#);
    let seqs: Vec<u64> = events
        .iter()
        .map(|e| e.data["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (0..events.len() as u64).collect::<Vec<_>>());

    // The call and its output in the input make the next turn: a streamed message.
    input.push(json!({"type": "function_call", "call_id": item["call_id"], "name": "exec_command", "arguments": "{}"}));
    input
        .push(json!({"type": "function_call_output", "call_id": item["call_id"], "output": "a b"}));
    let text = client
        .post(&url)
        .json(&json!({"model": "m", "input": input, "tools": responses_tools(), "stream": true}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = parse_sse(&text);
    let said: String = events
        .iter()
        .filter(|e| e.name.as_deref() == Some("response.output_text.delta"))
        .map(|e| e.data["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(said, "finished");
    let done = &events.last().unwrap().data["response"];
    assert_eq!(done["output"][0]["content"][0]["text"], "finished");
    let turns: Vec<Option<usize>> = server.requests().iter().map(|r| r.turn).collect();
    assert_eq!(turns, [Some(0), Some(0), Some(1)]);
}

#[tokio::test]
async fn a_delayed_turn_is_recorded_at_once_and_answered_late() {
    let script = Script::new().turn(Turn::text("late").delayed(Duration::from_millis(600)));
    let server = start(script).await;
    let url = format!("{}/v1/chat/completions", server.base_url());
    let started = Instant::now();
    let call = tokio::spawn(async move {
        reqwest::Client::new()
            .post(url)
            .json(
                &json!({"model": "m", "stream": true, "tools": chat_tools(PI_TOOLS),
                          "messages": [{"role": "user", "content": "go"}]}),
            )
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    // A cancel test waits for the request to arrive, then acts while the answer is held.
    let seen = server
        .wait_for(Duration::from_secs(5), |r| !r.is_empty())
        .await
        .expect("the request is recorded");
    assert_eq!(seen[0].turn, Some(0));
    // Recorded, and the answer still held back.
    assert!(!call.is_finished());
    let text = call.await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(600));
    let said: String = parse_sse(&text)
        .iter()
        .filter_map(|e| e.data["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(said, "late");
    assert!(
        server
            .wait_for(Duration::from_millis(50), |r| r.len() > 1)
            .await
            .is_none()
    );
}

#[tokio::test]
async fn a_required_key_refuses_other_keys_in_each_api_shape() {
    let server = ModelServer::start(
        Config::new("127.0.0.1:0".parse().unwrap(), script()).api_key("sk-right"),
    )
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let base = server.base_url();
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    let wrong = client
        .post(format!("{base}/v1/messages"))
        .header("x-api-key", "sk-wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let err: Value = wrong.json().await.unwrap();
    assert_eq!(err["error"]["type"], "authentication_error");
    let none = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(none.status(), 401);
    let err: Value = none.json().await.unwrap();
    assert!(err["error"]["message"].is_string());
    for req in [
        client
            .post(format!("{base}/v1/messages"))
            .header("x-api-key", "sk-right"),
        client
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("sk-right"),
    ] {
        assert_eq!(req.json(&body).send().await.unwrap().status(), 200);
    }
    let statuses: Vec<u16> = server.requests().iter().map(|r| r.status).collect();
    assert_eq!(statuses, [401, 401, 200, 200]);
    assert_eq!(server.requests()[0].api_key(), Some("sk-wrong"));
}

#[tokio::test]
async fn the_log_file_holds_each_request_as_a_json_line() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let server =
        ModelServer::start(Config::new("127.0.0.1:0".parse().unwrap(), script()).log(log.clone()))
            .await
            .unwrap();
    let client = reqwest::Client::new();
    for _ in 0..2 {
        client
            .post(format!("{}/v1/chat/completions", server.base_url()))
            .bearer_auth("k")
            .json(&json!({"model": "m", "tools": chat_tools(PI_TOOLS), "messages": [{"role": "user", "content": "x"}]}))
            .send()
            .await
            .unwrap();
    }
    let lines: Vec<sandpit_modelsim::RecordedRequest> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines, server.requests());
    assert_eq!(lines.len(), 2);
    server.stop().await;
    // Stopped means closed: nothing listens on the port any more.
    assert!(
        client
            .get(format!("http://{}/v1/models", lines[0].headers["host"]))
            .send()
            .await
            .is_err()
    );
}

#[tokio::test]
async fn a_turn_whose_tools_are_not_offered_says_so_in_the_answer() {
    let server = start(script()).await;
    let res: Value = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base_url()))
        .json(
            &json!({"model": "m", "tools": chat_tools(&[("read", &["path"])]),
                      "messages": [{"role": "user", "content": "x"}]}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let said = res["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        said.contains("modelsim: turn 0 wants one of the tools"),
        "{said}"
    );
    assert!(res["choices"][0]["message"]["tool_calls"].is_null());
    assert_eq!(server.requests()[0].note.as_deref(), Some(said));
}
