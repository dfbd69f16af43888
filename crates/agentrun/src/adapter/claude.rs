//! Claude Code, `claude -p --input-format stream-json --output-format stream-json
//! --verbose`: the task goes in as a `user` line on stdin, which stays open for control
//! messages (`interrupt`, answers to `can_use_tool` with `--permission-prompt-tool stdio`);
//! out come `system/init`, `stream_event` (Anthropic SSE events, with
//! `--include-partial-messages`), `assistant`, `user` (tool results) and `result` lines.
//! The model is `ANTHROPIC_BASE_URL` (no `/v1`) with `ANTHROPIC_API_KEY`.
//!
//! Checked against Claude Code 2.1.197 (Node 20) with a scripted Anthropic model on
//! loopback: the launch, `stream_event` deltas, a Bash tool call and its result, the
//! `result` line, `can_use_tool` answered allow and deny (no `initialize` request needed),
//! the interrupt (it stops the tool's child), and `--resume`.

use std::collections::{BTreeMap, HashMap};

use serde_json::{Value, json};

use super::{
    Adapter, Answer, Control, Harness, Launch, LaunchError, LaunchSpec, Outcome, Parsed,
    PermissionRequest, Resume, Stdin, StreamSource, WireApi, content_text, join, json_or_return,
    str_of, string_of, summarize, u64_of, written_path,
};
use crate::event::{Event, FileChange, Usage};

/// The Claude Code adapter.
#[derive(Debug, Default)]
pub struct Claude {
    /// Tool uses seen, by id: name and input (for tool results and file changes).
    calls: HashMap<String, (String, Value)>,
    /// Claude acknowledged our interrupt: the error result that follows is the abort.
    interrupted: bool,
}

/// The request id of the interrupt [`Claude::abort`] sends.
const INTERRUPT_ID: &str = "sandpit-interrupt";

fn usage_of(u: &Value, cost: Option<f64>) -> Usage {
    Usage {
        input_tokens: u64_of(u, "input_tokens"),
        output_tokens: u64_of(u, "output_tokens"),
        cache_read_tokens: u64_of(u, "cache_read_input_tokens"),
        cache_write_tokens: u64_of(u, "cache_creation_input_tokens"),
        cost_usd: cost,
    }
}

impl Claude {
    fn assistant(&mut self, message: &Value, out: &mut Parsed) {
        let blocks = message
            .get("content")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let text = content_text(&Value::Array(blocks.clone()));
        if !text.is_empty() {
            out.events.push(Event::message("assistant", text));
        }
        for block in blocks
            .iter()
            .filter(|b| str_of(b, "type") == Some("tool_use"))
        {
            let id = string_of(block, "id");
            let name = string_of(block, "name").unwrap_or_default();
            let input = block.get("input").cloned().unwrap_or(Value::Null);
            if let Some(id) = &id {
                self.calls.insert(id.clone(), (name.clone(), input.clone()));
            }
            out.events.push(Event::tool_call(id, name, input));
        }
    }

    fn tool_results(&mut self, message: &Value, out: &mut Parsed) {
        let Some(blocks) = message.get("content").and_then(Value::as_array) else {
            return;
        };
        for block in blocks
            .iter()
            .filter(|b| str_of(b, "type") == Some("tool_result"))
        {
            let id = string_of(block, "tool_use_id");
            let call = id.as_ref().and_then(|id| self.calls.remove(id));
            let output = content_text(block.get("content").unwrap_or(&Value::Null));
            let is_error = block
                .get("is_error")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let name = call.as_ref().map(|(n, _)| n.clone());
            out.events
                .push(Event::tool_result(id, name, output, is_error));
            if let Some((tool, input)) = call
                && !is_error
                && let Some(path) = written_path(&tool, &input)
            {
                out.events
                    .push(Event::file_change(path, FileChange::Modified));
            }
        }
    }
}

impl Adapter for Claude {
    fn harness(&self) -> Harness {
        Harness::Claude
    }

    fn launch(&self, spec: &LaunchSpec) -> Result<Launch, LaunchError> {
        let m = &spec.model;
        if m.api != WireApi::AnthropicMessages {
            return Err(LaunchError::UnsupportedApi {
                harness: Harness::Claude,
                api: m.api,
            });
        }
        let program = spec.program.clone().unwrap_or_else(|| "claude".into());
        let mut argv: Vec<String> = [
            program.as_str(),
            "-p",
            "--input-format",
            "stream-json",
            "--output-format",
            "stream-json",
            "--verbose",
            "--include-partial-messages",
            "--model",
            &m.model,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if spec.approvals {
            argv.extend(["--permission-prompt-tool".into(), "stdio".into()]);
        } else {
            argv.push("--dangerously-skip-permissions".into());
        }
        match &spec.resume {
            Some(Resume::Session(id)) => argv.extend(["--resume".into(), id.clone()]),
            Some(Resume::Latest) => argv.push("--continue".into()),
            None => {}
        }
        let env = BTreeMap::from([
            ("ANTHROPIC_BASE_URL".to_string(), m.base_url.clone()),
            ("ANTHROPIC_API_KEY".to_string(), m.api_key.clone()),
            (
                "CLAUDE_CONFIG_DIR".to_string(),
                join(&spec.state_dir, "claude"),
            ),
            (
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC".to_string(),
                "1".into(),
            ),
            ("DISABLE_AUTOUPDATER".to_string(), "1".into()),
            // Lets --dangerously-skip-permissions run as root: the sandbox is the boundary.
            ("IS_SANDBOX".to_string(), "1".into()),
        ]);
        let prompt = json!({"type": "user", "message": {"role": "user", "content": spec.task}});
        Ok(Launch {
            argv,
            env,
            files: Vec::new(),
            cwd: spec.workdir.clone(),
            stdin: Stdin::Lines,
            stream: StreamSource::Stdout,
            steps: vec![Control::StdinLine(prompt.to_string())],
            permission_requests: spec.approvals,
            stays_up: false,
            ready_output: None,
        })
    }

    fn abort(&self, _session_id: Option<&str>) -> Option<Control> {
        Some(Control::StdinLine(
            json!({"type": "control_request", "request_id": INTERRUPT_ID,
                   "request": {"subtype": "interrupt"}})
            .to_string(),
        ))
    }

    fn answer(&self, request: &PermissionRequest, answer: &Answer) -> Option<Control> {
        let decision = match answer {
            Answer::Allow { .. } => json!({"behavior": "allow", "updatedInput": request.input}),
            Answer::Deny { message } => json!({"behavior": "deny", "message": message}),
        };
        Some(Control::StdinLine(
            json!({"type": "control_response", "response": {"subtype": "success",
                   "request_id": request.id, "response": decision}})
            .to_string(),
        ))
    }

    fn parse(&mut self, input: &str) -> Parsed {
        let v = json_or_return!(input);
        let mut out = Parsed::default();
        match str_of(&v, "type").unwrap_or_default() {
            "system" if str_of(&v, "subtype") == Some("init") => {
                out.session_id = string_of(&v, "session_id");
                out.events
                    .push(Event::status("started", string_of(&v, "model")));
            }
            "stream_event" => {
                let e = v.get("event").unwrap_or(&Value::Null);
                if str_of(e, "type") == Some("content_block_delta") {
                    let d = e.get("delta").unwrap_or(&Value::Null);
                    match str_of(d, "type") {
                        Some("text_delta") => {
                            if let Some(t) = string_of(d, "text").filter(|t| !t.is_empty()) {
                                out.events.push(Event::message_delta(t));
                            }
                        }
                        Some("thinking_delta") => {
                            if let Some(t) = string_of(d, "thinking").filter(|t| !t.is_empty()) {
                                out.events.push(Event::reasoning_delta(t));
                            }
                        }
                        _ => {}
                    }
                }
            }
            "assistant" => self.assistant(v.get("message").unwrap_or(&Value::Null), &mut out),
            "user" => self.tool_results(v.get("message").unwrap_or(&Value::Null), &mut out),
            "result" => {
                out.session_id = string_of(&v, "session_id");
                let cost = v.get("total_cost_usd").and_then(Value::as_f64);
                let usage = usage_of(v.get("usage").unwrap_or(&Value::Null), cost);
                if !usage.is_empty() {
                    out.events.push(Event::usage(&usage));
                }
                let is_error = v.get("is_error").and_then(Value::as_bool).unwrap_or(false);
                let subtype = str_of(&v, "subtype").unwrap_or("error");
                let result = string_of(&v, "result");
                out.outcome = Some(if subtype == "success" && !is_error {
                    Outcome::Succeeded { result }
                } else if self.interrupted {
                    Outcome::Aborted
                } else {
                    let reason = match result.filter(|r| !r.is_empty()) {
                        Some(r) => format!("{subtype}: {r}"),
                        None => subtype.to_string(),
                    };
                    out.events.push(Event::error(reason.clone()));
                    Outcome::Failed { reason }
                });
            }
            "control_response" => {
                let r = v.get("response").unwrap_or(&Value::Null);
                if str_of(r, "request_id") == Some(INTERRUPT_ID)
                    && str_of(r, "subtype") == Some("success")
                {
                    self.interrupted = true;
                }
            }
            "control_request" => {
                let req = v.get("request").unwrap_or(&Value::Null);
                if str_of(req, "subtype") == Some("can_use_tool")
                    && let Some(id) = string_of(&v, "request_id")
                {
                    let tool = string_of(req, "tool_name").unwrap_or_else(|| "tool".into());
                    let input = req.get("input").cloned().unwrap_or(Value::Null);
                    out.permission = Some(PermissionRequest {
                        summary: summarize(&tool, &input),
                        call_id: string_of(req, "tool_use_id"),
                        id,
                        tool,
                        input,
                    });
                }
            }
            _ => {}
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EventKind;
    use crate::adapter::ModelEndpoint;

    fn spec() -> LaunchSpec {
        LaunchSpec {
            task: "write hello.txt".into(),
            model: ModelEndpoint {
                provider: "anthropic".into(),
                api: WireApi::AnthropicMessages,
                base_url: "https://models.example".into(),
                model: "claude-test".into(),
                api_key: "sandpit-placeholder-2".into(),
            },
            workdir: "/workspace".into(),
            state_dir: "/home/user/.sandpit/rt2".into(),
            resume: None,
            approvals: false,
            program: None,
        }
    }

    #[test]
    fn the_launch_is_headless_against_the_endpoint() {
        let l = Claude::default().launch(&spec()).unwrap();
        assert_eq!(l.argv[..2], ["claude", "-p"]);
        assert!(
            l.argv
                .windows(2)
                .any(|w| w == ["--output-format", "stream-json"])
        );
        assert!(
            l.argv
                .windows(2)
                .any(|w| w == ["--input-format", "stream-json"])
        );
        assert!(l.argv.windows(2).any(|w| w == ["--model", "claude-test"]));
        assert!(l.argv.contains(&"--verbose".to_string()));
        assert_eq!(l.argv.last().unwrap(), "--dangerously-skip-permissions");
        assert_eq!(l.env["ANTHROPIC_BASE_URL"], "https://models.example");
        assert_eq!(l.env["ANTHROPIC_API_KEY"], "sandpit-placeholder-2");
        assert_eq!(l.env["CLAUDE_CONFIG_DIR"], "/home/user/.sandpit/rt2/claude");
        assert_eq!(l.env["IS_SANDBOX"], "1");
        let [Control::StdinLine(prompt)] = &l.steps[..] else {
            panic!("{:?}", l.steps)
        };
        assert_eq!(
            serde_json::from_str::<Value>(prompt).unwrap(),
            json!({"type": "user", "message": {"role": "user", "content": "write hello.txt"}})
        );
        // The key is nowhere in argv.
        assert!(!l.argv.iter().any(|a| a.contains("placeholder")));

        let mut s = spec();
        s.approvals = true;
        s.resume = Some(Resume::Session("0b6c-uuid".into()));
        let l = Claude::default().launch(&s).unwrap();
        let tail: Vec<&str> = l.argv[l.argv.len() - 4..]
            .iter()
            .map(String::as_str)
            .collect();
        assert_eq!(
            tail,
            ["--permission-prompt-tool", "stdio", "--resume", "0b6c-uuid"]
        );
        assert!(l.permission_requests);
        s.resume = Some(Resume::Latest);
        assert_eq!(
            Claude::default().launch(&s).unwrap().argv.last().unwrap(),
            "--continue"
        );
        s.model.api = WireApi::ChatCompletions;
        assert_eq!(
            Claude::default().launch(&s),
            Err(LaunchError::UnsupportedApi {
                harness: Harness::Claude,
                api: WireApi::ChatCompletions
            })
        );
    }

    #[test]
    fn a_stream_maps_onto_envelope_events() {
        let mut c = Claude::default();
        let input = [
            json!({"type": "system", "subtype": "init", "session_id": "9f1c-uuid", "tools": ["Bash", "Write"], "model": "claude-test"}),
            json!({"type": "stream_event", "session_id": "9f1c-uuid", "event": {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Writing"}}}),
            json!({"type": "stream_event", "event": {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"fi"}}}),
            json!({"type": "stream_event", "event": {"type": "message_stop"}}),
            json!({"type": "assistant", "session_id": "9f1c-uuid", "message": {"id": "msg_1", "role": "assistant", "content": [
                {"type": "text", "text": "Writing the file."},
                {"type": "tool_use", "id": "toolu_1", "name": "Write", "input": {"file_path": "/workspace/hello.txt", "content": "hi"}}]}}),
            json!({"type": "user", "message": {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "File created successfully", "is_error": false}]}}),
            json!({"type": "assistant", "message": {"content": [{"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "cat nope"}}]}}),
            json!({"type": "user", "message": {"content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                "content": [{"type": "text", "text": "cat: nope: No such file"}], "is_error": true}]}}),
            json!({"type": "result", "subtype": "success", "is_error": false, "result": "Done.", "session_id": "9f1c-uuid",
                   "total_cost_usd": 0.0123, "usage": {"input_tokens": 50, "output_tokens": 9, "cache_read_input_tokens": 7, "cache_creation_input_tokens": 3}}),
        ];
        let out: Vec<Parsed> = input.iter().map(|l| c.parse(&l.to_string())).collect();
        assert_eq!(out[0].session_id.as_deref(), Some("9f1c-uuid"));
        let events: Vec<&Event> = out.iter().flat_map(|p| &p.events).collect();
        let kinds: Vec<EventKind> = events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [
                EventKind::Status,
                EventKind::MessageDelta,
                EventKind::Message,
                EventKind::ToolCall,
                EventKind::ToolResult,
                EventKind::FileChange,
                EventKind::ToolCall,
                EventKind::ToolResult,
                EventKind::Usage,
            ]
        );
        assert_eq!(events[1].payload, json!({"text": "Writing"}));
        assert_eq!(events[3].payload["name"], "Write");
        assert_eq!(
            events[4].payload,
            json!({"id": "toolu_1", "name": "Write", "output": "File created successfully", "is_error": false})
        );
        assert_eq!(
            events[5].payload,
            json!({"path": "/workspace/hello.txt", "change": "modified"})
        );
        assert_eq!(events[7].payload["output"], "cat: nope: No such file");
        assert_eq!(events[7].payload["is_error"], true);
        assert_eq!(
            events[8].payload,
            json!({"input_tokens": 50, "output_tokens": 9, "cache_read_tokens": 7, "cache_write_tokens": 3, "cost_usd": 0.0123})
        );
        assert_eq!(
            out[8].outcome,
            Some(Outcome::Succeeded {
                result: Some("Done.".into())
            })
        );
        assert!(out[..8].iter().all(|p| p.outcome.is_none()));
    }

    #[test]
    fn a_failed_result_is_a_failure() {
        let mut c = Claude::default();
        let out = c.parse(
            &json!({"type": "result", "subtype": "error_max_turns", "is_error": true, "session_id": "s"}).to_string(),
        );
        assert_eq!(
            out.outcome,
            Some(Outcome::Failed {
                reason: "error_max_turns".into()
            })
        );
        let out = c.parse(
            &json!({"type": "result", "subtype": "success", "is_error": true, "result": "API Error: 401"}).to_string(),
        );
        assert_eq!(
            out.outcome,
            Some(Outcome::Failed {
                reason: "success: API Error: 401".into()
            })
        );
        assert_eq!(out.events.last().unwrap().kind, EventKind::Error);
    }

    #[test]
    fn the_error_result_after_an_acknowledged_interrupt_is_an_abort() {
        // As Claude Code 2.1.197 answers an interrupt during a Bash call.
        let mut c = Claude::default();
        let ack = c.parse(
            &json!({"type": "control_response", "response": {"subtype": "success", "request_id": "sandpit-interrupt"}}).to_string(),
        );
        assert_eq!(ack, Parsed::default());
        let out = c.parse(
            &json!({"type": "result", "subtype": "error_during_execution", "is_error": true, "num_turns": 3,
                    "stop_reason": "tool_use", "session_id": "s"}).to_string(),
        );
        assert_eq!(out.outcome, Some(Outcome::Aborted));
    }

    #[test]
    fn can_use_tool_is_a_permission_request_answered_on_stdin() {
        let mut c = Claude::default();
        let out = c.parse(
            &json!({"type": "control_request", "request_id": "req_7", "request": {
                "subtype": "can_use_tool", "tool_name": "Bash", "input": {"command": "curl https://x.example"},
                "tool_use_id": "toolu_5"}})
            .to_string(),
        );
        let req = out.permission.unwrap();
        assert_eq!(
            (req.id.as_str(), req.tool.as_str(), req.call_id.as_deref()),
            ("req_7", "Bash", Some("toolu_5"))
        );
        assert_eq!(req.summary, "Bash: curl https://x.example");
        let Some(Control::StdinLine(allow)) = c.answer(&req, &Answer::Allow { for_run: true })
        else {
            panic!()
        };
        assert_eq!(
            serde_json::from_str::<Value>(&allow).unwrap(),
            json!({"type": "control_response", "response": {"subtype": "success", "request_id": "req_7",
                   "response": {"behavior": "allow", "updatedInput": {"command": "curl https://x.example"}}}})
        );
        let Some(Control::StdinLine(deny)) = c.answer(
            &req,
            &Answer::Deny {
                message: "denied by alice".into(),
            },
        ) else {
            panic!()
        };
        assert_eq!(
            serde_json::from_str::<Value>(&deny).unwrap()["response"]["response"],
            json!({"behavior": "deny", "message": "denied by alice"})
        );
        let Some(Control::StdinLine(stop)) = c.abort(Some("s")) else {
            panic!()
        };
        let stop: Value = serde_json::from_str(&stop).unwrap();
        assert_eq!(stop["type"], "control_request");
        assert_eq!(stop["request"]["subtype"], "interrupt");
        // Other control requests are not permission requests.
        let hook = c.parse(
            &json!({"type": "control_request", "request_id": "r", "request": {"subtype": "hook_callback"}}).to_string(),
        );
        assert!(hook.permission.is_none());
    }
}
