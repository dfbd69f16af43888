//! pi (`@mariozechner/pi-coding-agent`) in RPC mode: commands as JSON lines on stdin
//! (`prompt`, `abort`, `get_state`), the same event lines as `--mode json` on stdout plus
//! `response` lines. The model comes from `models.json` in `PI_CODING_AGENT_DIR`.
//!
//! pi asks no permission by itself; with approvals on, the launch loads a small extension
//! of sandpit's that asks before every `bash`, `edit` and `write` call through pi's
//! extension UI protocol (`extension_ui_request` confirm, answered by
//! `extension_ui_response`). pi also reads `--mode json` output: its `session` header
//! line gives the session id there.
//!
//! Checked against pi 0.73.1 with a scripted Chat Completions model on loopback: the
//! launch (`--offline` with `--mode rpc`), the events of a bash tool call, the outcome,
//! the extension's confirm answered allow and deny, `abort` (it stops the tool's child),
//! and `--session` with the `sessionFile` that `get_state` reports.

use std::collections::{BTreeMap, HashMap};

use serde_json::{Value, json};

use super::{
    Adapter, Answer, Control, Harness, Launch, LaunchError, LaunchFile, LaunchSpec, Outcome,
    Parsed, PermissionRequest, Resume, Stdin, StreamSource, WireApi, check_provider, content_text,
    join, json_or_return, str_of, string_of, summarize, u64_of, written_path,
};
use crate::event::{Event, FileChange, Usage};

/// Title of the confirm dialogs sandpit's extension opens; other dialogs are not ours.
pub const APPROVAL_TITLE: &str = "sandpit-approval";

/// The extension loaded with approvals on. It blocks the call unless confirmed; the
/// dialog's message is the call as JSON, which the adapter reads back.
const APPROVAL_EXTENSION: &str = r#"// Written by sandpit: every bash, edit and write call waits for sandpit's approval.
const GATED = new Set(["bash", "edit", "write"]);

export default function (pi) {
  pi.on("tool_call", async (event, ctx) => {
    if (!GATED.has(event.toolName)) return undefined;
    const call = JSON.stringify({ tool: event.toolName, toolCallId: event.toolCallId, input: event.input });
    const allowed = await ctx.ui.confirm("sandpit-approval", call);
    if (!allowed) return { block: true, reason: "refused by a sandpit approval" };
    return undefined;
  });
}
"#;

/// The pi adapter.
#[derive(Debug, Default)]
pub struct Pi {
    /// Tool calls seen, by id: name and arguments (for file changes).
    calls: HashMap<String, (String, Value)>,
    /// The last assistant message's text.
    last_text: Option<String>,
}

fn pi_api(api: WireApi) -> &'static str {
    match api {
        WireApi::ChatCompletions => "openai-completions",
        WireApi::Responses => "openai-responses",
        WireApi::AnthropicMessages => "anthropic-messages",
    }
}

fn usage_of(u: &Value) -> Usage {
    Usage {
        input_tokens: u64_of(u, "input"),
        output_tokens: u64_of(u, "output"),
        cache_read_tokens: u64_of(u, "cacheRead"),
        cache_write_tokens: u64_of(u, "cacheWrite"),
        cost_usd: u
            .get("cost")
            .and_then(|c| c.get("total"))
            .and_then(Value::as_f64),
    }
}

/// The last assistant message of an `agent_end`'s `messages`.
fn last_assistant(messages: Option<&Value>) -> Option<&Value> {
    messages?
        .as_array()?
        .iter()
        .rev()
        .find(|m| str_of(m, "role") == Some("assistant"))
}

impl Pi {
    fn outcome_of(&self, message: Option<&Value>) -> Outcome {
        let stop = message.and_then(|m| str_of(m, "stopReason"));
        match stop {
            Some("aborted") => Outcome::Aborted,
            Some("error") => Outcome::Failed {
                reason: message
                    .and_then(|m| string_of(m, "errorMessage"))
                    .unwrap_or_else(|| "the model call failed".into()),
            },
            _ => Outcome::Succeeded {
                result: message
                    .map(|m| content_text(m.get("content").unwrap_or(&Value::Null)))
                    .filter(|t| !t.is_empty())
                    .or_else(|| self.last_text.clone()),
            },
        }
    }
}

impl Adapter for Pi {
    fn harness(&self) -> Harness {
        Harness::Pi
    }

    fn launch(&self, spec: &LaunchSpec) -> Result<Launch, LaunchError> {
        let m = &spec.model;
        check_provider(&m.provider)?;
        let agent_dir = join(&spec.state_dir, "pi");
        let models = json!({
            "providers": {
                m.provider.clone(): {
                    "baseUrl": m.base_url,
                    "api": pi_api(m.api),
                    "apiKey": m.api_key,
                    "models": [{ "id": m.model }],
                }
            }
        });
        let mut files = vec![LaunchFile {
            path: join(&agent_dir, "models.json"),
            contents: models.to_string(),
            mode: 0o600,
        }];
        let program = spec.program.clone().unwrap_or_else(|| "pi".into());
        let mut argv: Vec<String> = [
            program.as_str(),
            "--mode",
            "rpc",
            "--provider",
            &m.provider,
            "--model",
            &m.model,
            "--offline",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if spec.approvals {
            let path = join(&agent_dir, "sandpit-approval.ts");
            files.push(LaunchFile {
                path: path.clone(),
                contents: APPROVAL_EXTENSION.into(),
                mode: 0o644,
            });
            argv.extend(["-e".into(), path]);
        }
        match &spec.resume {
            Some(Resume::Session(file)) => argv.extend(["--session".into(), file.clone()]),
            Some(Resume::Latest) => argv.push("-c".into()),
            None => {}
        }
        let env = BTreeMap::from([("PI_CODING_AGENT_DIR".to_string(), agent_dir)]);
        let steps = vec![
            // The state names the session file, which `--session` takes to continue.
            Control::StdinLine(json!({"id": "sandpit-state", "type": "get_state"}).to_string()),
            Control::StdinLine(
                json!({"id": "sandpit-prompt", "type": "prompt", "message": spec.task}).to_string(),
            ),
        ];
        Ok(Launch {
            argv,
            env,
            files,
            cwd: spec.workdir.clone(),
            stdin: Stdin::Lines,
            stream: StreamSource::Stdout,
            steps,
            permission_requests: spec.approvals,
            stays_up: false,
            ready_output: None,
        })
    }

    fn abort(&self, _session_id: Option<&str>) -> Option<Control> {
        Some(Control::StdinLine(json!({"type": "abort"}).to_string()))
    }

    fn answer(&self, request: &PermissionRequest, answer: &Answer) -> Option<Control> {
        let confirmed = matches!(answer, Answer::Allow { .. });
        Some(Control::StdinLine(
            json!({"type": "extension_ui_response", "id": request.id, "confirmed": confirmed})
                .to_string(),
        ))
    }

    fn parse(&mut self, input: &str) -> Parsed {
        let v = json_or_return!(input);
        let mut out = Parsed::default();
        match str_of(&v, "type").unwrap_or_default() {
            "session" => out.session_id = string_of(&v, "id"),
            "response" => {
                let data = v.get("data").unwrap_or(&Value::Null);
                if v.get("success").and_then(Value::as_bool) == Some(false) {
                    let error = string_of(&v, "error").unwrap_or_else(|| "command failed".into());
                    out.events.push(Event::error(error.clone()));
                    if str_of(&v, "command") == Some("prompt") {
                        out.outcome = Some(Outcome::Failed { reason: error });
                    }
                } else if str_of(&v, "command") == Some("get_state") {
                    out.session_id =
                        string_of(data, "sessionFile").or_else(|| string_of(data, "sessionId"));
                }
            }
            "agent_start" => out.events.push(Event::status("busy", None)),
            "message_update" => {
                let e = v.get("assistantMessageEvent").unwrap_or(&Value::Null);
                let delta = string_of(e, "delta").unwrap_or_default();
                match str_of(e, "type") {
                    Some("text_delta") if !delta.is_empty() => {
                        out.events.push(Event::message_delta(delta))
                    }
                    Some("thinking_delta") if !delta.is_empty() => {
                        out.events.push(Event::reasoning_delta(delta))
                    }
                    _ => {}
                }
            }
            "message_end" => {
                let m = v.get("message").unwrap_or(&Value::Null);
                if str_of(m, "role") == Some("assistant") {
                    let text = content_text(m.get("content").unwrap_or(&Value::Null));
                    if !text.is_empty() {
                        out.events.push(Event::message("assistant", text.clone()));
                        self.last_text = Some(text);
                    }
                    if let Some(u) = m.get("usage") {
                        let usage = usage_of(u);
                        if !usage.is_empty() {
                            out.events.push(Event::usage(&usage));
                        }
                    }
                    if str_of(m, "stopReason") == Some("error") {
                        let error = string_of(m, "errorMessage")
                            .unwrap_or_else(|| "the model call failed".into());
                        out.events.push(Event::error(error));
                    }
                }
            }
            "tool_execution_start" => {
                let id = string_of(&v, "toolCallId");
                let name = string_of(&v, "toolName").unwrap_or_default();
                let args = v.get("args").cloned().unwrap_or(Value::Null);
                if let Some(id) = &id {
                    self.calls.insert(id.clone(), (name.clone(), args.clone()));
                }
                out.events.push(Event::tool_call(id, name, args));
            }
            "tool_execution_end" => {
                let id = string_of(&v, "toolCallId");
                let name = string_of(&v, "toolName");
                let result = v.get("result").unwrap_or(&Value::Null);
                let output = content_text(result.get("content").unwrap_or(result));
                let is_error = v.get("isError").and_then(Value::as_bool).unwrap_or(false);
                let call = id.as_ref().and_then(|id| self.calls.remove(id));
                out.events
                    .push(Event::tool_result(id, name.clone(), output, is_error));
                if let Some((tool, args)) = call
                    && !is_error
                    && let Some(path) = written_path(&tool, &args)
                {
                    out.events
                        .push(Event::file_change(path, FileChange::Modified));
                }
            }
            "auto_retry_start" => out
                .events
                .push(Event::status("retrying", string_of(&v, "errorMessage"))),
            "extension_error" => out.events.push(Event::error(
                string_of(&v, "error").unwrap_or_else(|| "extension error".into()),
            )),
            "extension_ui_request" => {
                if str_of(&v, "method") == Some("confirm")
                    && str_of(&v, "title") == Some(APPROVAL_TITLE)
                    && let Some(id) = string_of(&v, "id")
                {
                    let call: Value = str_of(&v, "message")
                        .and_then(|m| serde_json::from_str(m).ok())
                        .unwrap_or(Value::Null);
                    let tool = string_of(&call, "tool").unwrap_or_else(|| "tool".into());
                    let input = call.get("input").cloned().unwrap_or(Value::Null);
                    out.permission = Some(PermissionRequest {
                        summary: summarize(&tool, &input),
                        call_id: string_of(&call, "toolCallId"),
                        id,
                        tool,
                        input,
                    });
                }
            }
            "agent_end" => {
                let last = last_assistant(v.get("messages"));
                out.outcome = Some(self.outcome_of(last));
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
            task: "fix the failing test".into(),
            model: ModelEndpoint {
                provider: "sandpit".into(),
                api: WireApi::ChatCompletions,
                base_url: "https://models.example/v1".into(),
                model: "coder-1".into(),
                api_key: "sandpit-placeholder-1".into(),
            },
            workdir: "/workspace".into(),
            state_dir: "/home/user/.sandpit/rt1/".into(),
            resume: None,
            approvals: false,
            program: None,
        }
    }

    fn lines(p: &mut Pi, input: &[Value]) -> Vec<Parsed> {
        input.iter().map(|l| p.parse(&l.to_string())).collect()
    }

    #[test]
    fn the_launch_points_pi_at_the_endpoint_with_the_placeholder() {
        let l = Pi::default().launch(&spec()).unwrap();
        assert_eq!(
            l.argv,
            [
                "pi",
                "--mode",
                "rpc",
                "--provider",
                "sandpit",
                "--model",
                "coder-1",
                "--offline"
            ]
        );
        assert_eq!(l.env["PI_CODING_AGENT_DIR"], "/home/user/.sandpit/rt1/pi");
        assert_eq!(l.files.len(), 1);
        assert_eq!(l.files[0].path, "/home/user/.sandpit/rt1/pi/models.json");
        let models: Value = serde_json::from_str(&l.files[0].contents).unwrap();
        assert_eq!(
            models,
            json!({"providers": {"sandpit": {"baseUrl": "https://models.example/v1",
                "api": "openai-completions", "apiKey": "sandpit-placeholder-1",
                "models": [{"id": "coder-1"}]}}})
        );
        assert_eq!(l.stdin, Stdin::Lines);
        assert_eq!(l.stream, StreamSource::Stdout);
        assert_eq!(l.cwd, "/workspace");
        let Control::StdinLine(prompt) = &l.steps[1] else {
            panic!("{:?}", l.steps)
        };
        let prompt: Value = serde_json::from_str(prompt).unwrap();
        assert_eq!(prompt["type"], "prompt");
        assert_eq!(prompt["message"], "fix the failing test");
        assert!(!l.permission_requests);
    }

    #[test]
    fn continue_approvals_and_abort_as_data() {
        let mut s = spec();
        s.resume = Some(Resume::Session("/s/2025.jsonl".into()));
        s.approvals = true;
        s.program = Some("/opt/pi/bin/pi".into());
        let l = Pi::default().launch(&s).unwrap();
        assert_eq!(l.argv[0], "/opt/pi/bin/pi");
        let tail: Vec<&str> = l.argv[8..].iter().map(String::as_str).collect();
        assert_eq!(
            tail,
            [
                "-e",
                "/home/user/.sandpit/rt1/pi/sandpit-approval.ts",
                "--session",
                "/s/2025.jsonl"
            ]
        );
        assert!(l.files[1].contents.contains("sandpit-approval"));
        assert!(l.permission_requests);
        s.resume = Some(Resume::Latest);
        assert_eq!(Pi::default().launch(&s).unwrap().argv.last().unwrap(), "-c");
        assert_eq!(
            Pi::default().abort(None),
            Some(Control::StdinLine("{\"type\":\"abort\"}".into()))
        );
        s.model.provider = "bad name".into();
        assert_eq!(
            Pi::default().launch(&s),
            Err(LaunchError::BadProvider("bad name".into()))
        );
    }

    #[test]
    fn a_run_maps_onto_envelope_events() {
        let mut p = Pi::default();
        let out = lines(
            &mut p,
            &[
                json!({"type": "session", "version": 3, "id": "ses-json-1", "cwd": "/w"}),
                json!({"id": "sandpit-state", "type": "response", "command": "get_state", "success": true,
                       "data": {"sessionFile": "/s/a.jsonl", "sessionId": "abc"}}),
                json!({"type": "agent_start"}),
                json!({"type": "message_update", "message": {}, "assistantMessageEvent": {"type": "thinking_delta", "delta": "hmm"}}),
                json!({"type": "message_update", "message": {}, "assistantMessageEvent": {"type": "text_delta", "contentIndex": 0, "delta": "I'll "}}),
                json!({"type": "message_update", "message": {}, "assistantMessageEvent": {"type": "toolcall_delta", "delta": "{\"pa"}}),
                json!({"type": "tool_execution_start", "toolCallId": "call_1", "toolName": "write", "args": {"path": "/w/a.txt", "content": "x"}}),
                json!({"type": "tool_execution_end", "toolCallId": "call_1", "toolName": "write",
                       "result": {"content": [{"type": "text", "text": "wrote 1 byte"}]}, "isError": false}),
                json!({"type": "tool_execution_start", "toolCallId": "call_2", "toolName": "bash", "args": {"command": "false"}}),
                json!({"type": "tool_execution_end", "toolCallId": "call_2", "toolName": "bash",
                       "result": {"content": [{"type": "text", "text": "exit 1"}]}, "isError": true}),
                json!({"type": "message_end", "message": {"role": "assistant",
                       "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "Done."}],
                       "usage": {"input": 100, "output": 20, "cacheRead": 5, "cacheWrite": 0, "cost": {"total": 0.002}},
                       "stopReason": "stop"}}),
                json!({"type": "agent_end", "messages": [{"role": "user", "content": "fix"},
                       {"role": "assistant", "content": [{"type": "text", "text": "Done."}], "stopReason": "stop"}]}),
            ],
        );
        assert_eq!(out[0].session_id.as_deref(), Some("ses-json-1"));
        assert_eq!(out[1].session_id.as_deref(), Some("/s/a.jsonl"));
        let events: Vec<&Event> = out.iter().flat_map(|p| &p.events).collect();
        let kinds: Vec<EventKind> = events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [
                EventKind::Status,
                EventKind::ReasoningDelta,
                EventKind::MessageDelta,
                EventKind::ToolCall,
                EventKind::ToolResult,
                EventKind::FileChange,
                EventKind::ToolCall,
                EventKind::ToolResult,
                EventKind::Message,
                EventKind::Usage,
            ]
        );
        assert_eq!(events[2].payload, json!({"text": "I'll "}));
        assert_eq!(
            events[3].payload,
            json!({"id": "call_1", "name": "write", "input": {"path": "/w/a.txt", "content": "x"}})
        );
        assert_eq!(events[4].payload["output"], "wrote 1 byte");
        assert_eq!(
            events[5].payload,
            json!({"path": "/w/a.txt", "change": "modified"})
        );
        assert_eq!(events[7].payload["is_error"], true);
        assert_eq!(
            events[8].payload,
            json!({"role": "assistant", "text": "Done."})
        );
        assert_eq!(
            events[9].payload,
            json!({"input_tokens": 100, "output_tokens": 20, "cache_read_tokens": 5, "cache_write_tokens": 0, "cost_usd": 0.002})
        );
        assert!(out[..11].iter().all(|p| p.outcome.is_none()));
        assert_eq!(
            out[11].outcome,
            Some(Outcome::Succeeded {
                result: Some("Done.".into())
            })
        );
    }

    #[test]
    fn errors_aborts_and_failed_prompts() {
        let mut p = Pi::default();
        let failed = p.parse(
            &json!({"type": "agent_end", "messages": [{"role": "assistant", "content": [],
                    "stopReason": "error", "errorMessage": "401 unauthorized"}]})
            .to_string(),
        );
        assert_eq!(
            failed.outcome,
            Some(Outcome::Failed {
                reason: "401 unauthorized".into()
            })
        );
        let aborted = p.parse(
            &json!({"type": "agent_end", "messages": [{"role": "assistant", "stopReason": "aborted"}]})
                .to_string(),
        );
        assert_eq!(aborted.outcome, Some(Outcome::Aborted));
        let refused = p.parse(
            &json!({"id": "sandpit-prompt", "type": "response", "command": "prompt", "success": false, "error": "no model"})
                .to_string(),
        );
        assert_eq!(refused.events, [Event::error("no model")]);
        assert_eq!(
            refused.outcome,
            Some(Outcome::Failed {
                reason: "no model".into()
            })
        );
        let end = p.parse(
            &json!({"type": "message_end", "message": {"role": "assistant", "content": [], "stopReason": "error", "errorMessage": "overloaded"}})
                .to_string(),
        );
        assert_eq!(end.events, [Event::error("overloaded")]);
        // User messages are not reported as the agent's.
        let user = p.parse(
            &json!({"type": "message_end", "message": {"role": "user", "content": "fix"}})
                .to_string(),
        );
        assert!(user.events.is_empty());
        assert!(p.parse("npm WARN something").unrecognized);
        assert_eq!(p.parse("   "), Parsed::default());
        assert!(p.parse("[1,2]").unrecognized);
    }

    #[test]
    fn the_extension_confirm_is_a_permission_request_and_gets_its_answer() {
        let mut p = Pi::default();
        let call =
            json!({"tool": "bash", "toolCallId": "call_9", "input": {"command": "rm -rf build"}});
        let out = p.parse(
            &json!({"type": "extension_ui_request", "id": "ui-1", "method": "confirm",
                    "title": APPROVAL_TITLE, "message": call.to_string()})
            .to_string(),
        );
        let req = out.permission.unwrap();
        assert_eq!(req.id, "ui-1");
        assert_eq!(req.tool, "bash");
        assert_eq!(req.call_id.as_deref(), Some("call_9"));
        assert_eq!(req.summary, "bash: rm -rf build");
        let Some(Control::StdinLine(yes)) = p.answer(&req, &Answer::Allow { for_run: false })
        else {
            panic!()
        };
        assert_eq!(
            serde_json::from_str::<Value>(&yes).unwrap(),
            json!({"type": "extension_ui_response", "id": "ui-1", "confirmed": true})
        );
        let Some(Control::StdinLine(no)) = p.answer(
            &req,
            &Answer::Deny {
                message: "no".into(),
            },
        ) else {
            panic!()
        };
        assert_eq!(
            serde_json::from_str::<Value>(&no).unwrap()["confirmed"],
            false
        );
        // Another extension's dialog or a notification is not a request of ours.
        let other = p.parse(
            &json!({"type": "extension_ui_request", "id": "ui-2", "method": "confirm", "title": "Clear session?"})
                .to_string(),
        );
        assert!(other.permission.is_none());
        let notify = p.parse(
            &json!({"type": "extension_ui_request", "id": "ui-3", "method": "notify", "message": "x"})
                .to_string(),
        );
        assert!(notify.permission.is_none());
    }
}
