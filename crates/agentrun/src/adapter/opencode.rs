//! opencode (`opencode-ai`) driven through `opencode serve`: the config (provider through
//! `@ai-sdk/openai-compatible`, permissions) goes in `OPENCODE_CONFIG_CONTENT`; the run is
//! `POST /session` then `POST /session/{id}/prompt_async`; events come from `GET /event`
//! (SSE, `{"type": ..., "properties": {...}}`). Aborting is `POST /session/{id}/abort`;
//! with approvals on, `bash`, `edit` and `webfetch` are `ask` and arrive as
//! `permission.asked`, answered by `POST /permission/{id}/reply`. The server stays up after
//! the run; the same session continues on it (or on a new server with the same data dir).
//!
//! The parser has been run over the SSE stream opencode 1.18.33 `serve` sent for a
//! scripted write-then-cat run (its `file.edited` carries the absolute path, so file
//! changes come from there, not from the tool's input), and the launch driven against
//! 1.18.33 with a scripted model on loopback: a bash call asked as `permission.asked` and
//! answered allow and reject (the reply body below is accepted), and the abort (it stops
//! the tool's child). The first request to a server that is still starting may hang:
//! wait for [`Launch::ready_output`] and use short timeouts with retries.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::{Value, json};

use super::{
    Adapter, Answer, Control, Harness, HttpCall, Launch, LaunchError, LaunchSpec, Outcome, Parsed,
    PermissionRequest, Resume, SESSION_PLACEHOLDER, Stdin, StreamSource, WireApi, check_provider,
    join, json_or_return, sse_data, str_of, string_of, summarize, u64_of,
};
use crate::event::{Event, FileChange, Usage};

/// The opencode adapter.
#[derive(Debug)]
pub struct OpenCode {
    /// Loopback port the server listens on inside the sandbox.
    port: u16,
    /// The run's session; events of other sessions are ignored.
    session: Option<String>,
    /// Part id → part type (`text`, `reasoning`, `tool`, ...).
    parts: HashMap<String, String>,
    /// Message id → role.
    roles: HashMap<String, String>,
    /// Tool calls announced, and those finished.
    announced: HashSet<String>,
    finished: HashSet<String>,
    /// Text parts and messages already reported whole.
    done: HashSet<String>,
    /// The session went busy (so an idle after it ends the run).
    busy: bool,
    /// An outcome was reported.
    ended: bool,
    /// The last error the session reported, and whether it was an abort.
    error: Option<String>,
    aborted: bool,
    /// The last assistant text.
    last_text: Option<String>,
}

impl Default for OpenCode {
    fn default() -> OpenCode {
        OpenCode::with_port(OpenCode::DEFAULT_PORT)
    }
}

/// The session a bus event belongs to, wherever the event type keeps it.
fn session_of(props: &Value) -> Option<&str> {
    str_of(props, "sessionID")
        .or_else(|| props.get("info").and_then(|i| str_of(i, "sessionID")))
        .or_else(|| props.get("part").and_then(|p| str_of(p, "sessionID")))
}

/// `(message, is_abort)` of an opencode error object (`{name, data: {message}}`).
fn error_of(e: &Value) -> (String, bool) {
    let name = str_of(e, "name").unwrap_or("Error");
    let message = e
        .get("data")
        .and_then(|d| string_of(d, "message"))
        .unwrap_or_else(|| name.to_string());
    (message, name == "MessageAbortedError")
}

impl OpenCode {
    /// The port `opencode serve` listens on unless told otherwise.
    pub const DEFAULT_PORT: u16 = 4096;

    /// An adapter for a server on `port`.
    pub fn with_port(port: u16) -> OpenCode {
        OpenCode {
            port,
            session: None,
            parts: HashMap::new(),
            roles: HashMap::new(),
            announced: HashSet::new(),
            finished: HashSet::new(),
            done: HashSet::new(),
            busy: false,
            ended: false,
            error: None,
            aborted: false,
            last_text: None,
        }
    }

    fn prompt(spec: &LaunchSpec, session: &str) -> Control {
        Control::Http(HttpCall {
            method: "POST".into(),
            path: format!("/session/{session}/prompt_async"),
            body: Some(json!({
                "parts": [{"type": "text", "text": spec.task}],
                "model": {"providerID": spec.model.provider, "modelID": spec.model.model},
            })),
            session_from: None,
        })
    }

    fn finish(&mut self, out: &mut Parsed) {
        if !self.busy || self.ended {
            return;
        }
        self.ended = true;
        out.outcome = Some(if self.aborted {
            Outcome::Aborted
        } else if let Some(reason) = self.error.clone() {
            Outcome::Failed { reason }
        } else {
            Outcome::Succeeded {
                result: self.last_text.clone(),
            }
        });
    }

    fn on_error(&mut self, e: &Value, out: &mut Parsed) {
        let (message, abort) = error_of(e);
        if abort {
            self.aborted = true;
        } else {
            out.events.push(Event::error(message.clone()));
            self.error = Some(message);
        }
    }

    fn message_updated(&mut self, info: &Value, out: &mut Parsed) {
        let Some(id) = string_of(info, "id") else {
            return;
        };
        let role = string_of(info, "role").unwrap_or_default();
        self.roles.insert(id.clone(), role.clone());
        if role != "assistant" {
            return;
        }
        if let Some(e) = info.get("error")
            && self.done.insert(format!("error:{id}"))
        {
            self.on_error(e, out);
        }
        let completed = info.get("time").and_then(|t| t.get("completed")).is_some();
        if completed && self.done.insert(format!("usage:{id}")) {
            let t = info.get("tokens").unwrap_or(&Value::Null);
            let cache = t.get("cache").unwrap_or(&Value::Null);
            let usage = Usage {
                input_tokens: u64_of(t, "input"),
                output_tokens: u64_of(t, "output"),
                cache_read_tokens: u64_of(cache, "read"),
                cache_write_tokens: u64_of(cache, "write"),
                cost_usd: info.get("cost").and_then(Value::as_f64),
            };
            if !usage.is_empty() {
                out.events.push(Event::usage(&usage));
            }
        }
    }

    fn part_updated(&mut self, props: &Value, out: &mut Parsed) {
        let part = props.get("part").unwrap_or(&Value::Null);
        let id = string_of(part, "id").unwrap_or_default();
        let kind = string_of(part, "type").unwrap_or_default();
        self.parts.insert(id.clone(), kind.clone());
        let message = str_of(part, "messageID").unwrap_or_default();
        if self.roles.get(message).is_some_and(|r| r != "assistant") {
            return;
        }
        // Servers before `message.part.delta` sent the delta with the update.
        let delta = string_of(props, "delta").filter(|d| !d.is_empty());
        match kind.as_str() {
            "text" => {
                if let Some(d) = delta {
                    out.events.push(Event::message_delta(d));
                }
                let ended = part.get("time").and_then(|t| t.get("end")).is_some();
                let text = string_of(part, "text").unwrap_or_default();
                if ended && !text.is_empty() && self.done.insert(id) {
                    out.events.push(Event::message("assistant", text.clone()));
                    self.last_text = Some(text);
                }
            }
            "reasoning" => {
                if let Some(d) = delta {
                    out.events.push(Event::reasoning_delta(d));
                }
            }
            "tool" => self.tool_part(part, out),
            _ => {}
        }
    }

    fn tool_part(&mut self, part: &Value, out: &mut Parsed) {
        let Some(call) = string_of(part, "callID") else {
            return;
        };
        let tool = string_of(part, "tool").unwrap_or_default();
        let state = part.get("state").unwrap_or(&Value::Null);
        let status = str_of(state, "status").unwrap_or_default();
        let input = state.get("input").cloned().unwrap_or(Value::Null);
        // `pending` may carry half an input; announce the call once it runs (or ends).
        if matches!(status, "running" | "completed" | "error")
            && self.announced.insert(call.clone())
        {
            out.events.push(Event::tool_call(
                Some(call.clone()),
                tool.clone(),
                input.clone(),
            ));
        }
        let is_error = match status {
            "completed" => false,
            "error" => true,
            _ => return,
        };
        if !self.finished.insert(call.clone()) {
            return;
        }
        let output = if is_error {
            string_of(state, "error").unwrap_or_default()
        } else {
            string_of(state, "output").unwrap_or_default()
        };
        // No file change from the tool's input: opencode reports it as `file.edited`, with
        // the absolute path (the input's may be relative).
        out.events
            .push(Event::tool_result(Some(call), Some(tool), output, is_error));
    }
}

impl Adapter for OpenCode {
    fn harness(&self) -> Harness {
        Harness::OpenCode
    }

    fn launch(&self, spec: &LaunchSpec) -> Result<Launch, LaunchError> {
        let m = &spec.model;
        if m.api != WireApi::ChatCompletions {
            return Err(LaunchError::UnsupportedApi {
                harness: Harness::OpenCode,
                api: m.api,
            });
        }
        check_provider(&m.provider)?;
        let rule = if spec.approvals { "ask" } else { "allow" };
        let config = json!({
            "provider": {
                m.provider.clone(): {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": m.provider,
                    "options": {"baseURL": m.base_url, "apiKey": m.api_key},
                    "models": {m.model.clone(): {}},
                }
            },
            "model": format!("{}/{}", m.provider, m.model),
            "autoupdate": false,
            "share": "disabled",
            "permission": {"bash": rule, "edit": rule, "webfetch": rule},
        });
        let program = spec.program.clone().unwrap_or_else(|| "opencode".into());
        let argv = vec![
            program,
            "serve".into(),
            "--port".into(),
            self.port.to_string(),
            "--hostname".into(),
            "127.0.0.1".into(),
        ];
        let env = BTreeMap::from([
            ("OPENCODE_CONFIG_CONTENT".to_string(), config.to_string()),
            ("OPENCODE_DISABLE_MODELS_FETCH".to_string(), "1".into()),
            ("OPENCODE_DISABLE_AUTOUPDATE".to_string(), "1".into()),
            // Sessions live under the data dir: the runtime's own, so continue finds them.
            (
                "XDG_DATA_HOME".to_string(),
                join(&spec.state_dir, "opencode"),
            ),
        ]);
        let steps = match &spec.resume {
            Some(Resume::Session(id)) => vec![OpenCode::prompt(spec, id)],
            Some(Resume::Latest) => return Err(LaunchError::NeedsSessionId(Harness::OpenCode)),
            None => vec![
                Control::Http(HttpCall {
                    method: "POST".into(),
                    path: "/session".into(),
                    body: Some(json!({"title": "sandpit run"})),
                    session_from: Some("/id".into()),
                }),
                OpenCode::prompt(spec, SESSION_PLACEHOLDER),
            ],
        };
        Ok(Launch {
            argv,
            env,
            files: Vec::new(),
            cwd: spec.workdir.clone(),
            stdin: Stdin::Unused,
            stream: StreamSource::Sse {
                port: self.port,
                path: "/event".into(),
            },
            steps,
            permission_requests: spec.approvals,
            stays_up: true,
            // A request that arrives while the server is still starting may go unanswered
            // (seen with 1.18.33): wait for this line, and retry with a short timeout.
            ready_output: Some("opencode server listening on".into()),
        })
    }

    fn abort(&self, session_id: Option<&str>) -> Option<Control> {
        let session = session_id
            .or(self.session.as_deref())
            .unwrap_or(SESSION_PLACEHOLDER);
        Some(Control::Http(HttpCall {
            method: "POST".into(),
            path: format!("/session/{session}/abort"),
            body: None,
            session_from: None,
        }))
    }

    fn answer(&self, request: &PermissionRequest, answer: &Answer) -> Option<Control> {
        let body = match answer {
            Answer::Allow { for_run: false } => json!({"reply": "once"}),
            Answer::Allow { for_run: true } => json!({"reply": "always"}),
            Answer::Deny { message } => json!({"reply": "reject", "message": message}),
        };
        Some(Control::Http(HttpCall {
            method: "POST".into(),
            path: format!("/permission/{}/reply", request.id),
            body: Some(body),
            session_from: None,
        }))
    }

    fn session_started(&mut self, session_id: &str) {
        self.session = Some(session_id.to_string());
    }

    fn parse(&mut self, input: &str) -> Parsed {
        let v = json_or_return!(&sse_data(input));
        let ty = str_of(&v, "type").unwrap_or_default().to_string();
        let props = v.get("properties").cloned().unwrap_or(Value::Null);
        let mut out = Parsed::default();
        if let Some(sid) = session_of(&props) {
            match &self.session {
                Some(mine) if mine != sid => return out,
                Some(_) => {}
                None => {
                    self.session = Some(sid.to_string());
                    out.session_id = Some(sid.to_string());
                }
            }
        }
        match ty.as_str() {
            "message.updated" => {
                self.message_updated(props.get("info").unwrap_or(&Value::Null), &mut out)
            }
            "message.part.updated" => self.part_updated(&props, &mut out),
            "message.part.delta" => {
                let message = str_of(&props, "messageID").unwrap_or_default();
                let user = self.roles.get(message).is_some_and(|r| r != "assistant");
                let delta = string_of(&props, "delta").filter(|d| !d.is_empty());
                if let (false, Some("text"), Some(d)) = (user, str_of(&props, "field"), delta) {
                    let part = str_of(&props, "partID").unwrap_or_default();
                    if self.parts.get(part).map(String::as_str) == Some("reasoning") {
                        out.events.push(Event::reasoning_delta(d));
                    } else {
                        out.events.push(Event::message_delta(d));
                    }
                }
            }
            "session.status" => {
                let status = props.get("status").unwrap_or(&Value::Null);
                match str_of(status, "type") {
                    Some("busy") if !self.busy => {
                        self.busy = true;
                        out.events.push(Event::status("busy", None));
                    }
                    Some("idle") => self.finish(&mut out),
                    Some("retry") => out
                        .events
                        .push(Event::status("retrying", string_of(status, "message"))),
                    _ => {}
                }
            }
            "session.idle" => self.finish(&mut out),
            "session.error" => {
                if let Some(e) = props.get("error") {
                    self.on_error(e, &mut out);
                }
            }
            "permission.asked" | "permission.updated" => {
                if let Some(id) = string_of(&props, "id") {
                    let tool = string_of(&props, "permission")
                        .or_else(|| string_of(&props, "type"))
                        .unwrap_or_else(|| "permission".into());
                    let mut input = props.get("metadata").cloned().unwrap_or(json!({}));
                    if let (Some(map), Some(patterns)) =
                        (input.as_object_mut(), props.get("patterns"))
                    {
                        map.insert("patterns".into(), patterns.clone());
                    }
                    out.permission = Some(PermissionRequest {
                        summary: summarize(&tool, &input),
                        call_id: props.get("tool").and_then(|t| string_of(t, "callID")),
                        id,
                        tool,
                        input,
                    });
                }
            }
            "file.edited" => {
                if let Some(file) = string_of(&props, "file") {
                    out.events
                        .push(Event::file_change(file, FileChange::Modified));
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
            task: "build the app".into(),
            model: ModelEndpoint {
                provider: "sandpit".into(),
                api: WireApi::ChatCompletions,
                base_url: "https://models.example/v1".into(),
                model: "coder-1".into(),
                api_key: "sandpit-placeholder-3".into(),
            },
            workdir: "/workspace/app".into(),
            state_dir: "/home/user/.sandpit/rt3".into(),
            resume: None,
            approvals: true,
            program: None,
        }
    }

    fn sse(v: Value) -> String {
        format!("data: {v}\n\n")
    }

    #[test]
    fn the_launch_is_a_server_with_the_config_in_env() {
        let l = OpenCode::with_port(4100).launch(&spec()).unwrap();
        assert_eq!(
            l.argv,
            [
                "opencode",
                "serve",
                "--port",
                "4100",
                "--hostname",
                "127.0.0.1"
            ]
        );
        let config: Value = serde_json::from_str(&l.env["OPENCODE_CONFIG_CONTENT"]).unwrap();
        assert_eq!(
            config["provider"]["sandpit"]["options"],
            json!({"baseURL": "https://models.example/v1", "apiKey": "sandpit-placeholder-3"})
        );
        assert_eq!(
            config["provider"]["sandpit"]["npm"],
            "@ai-sdk/openai-compatible"
        );
        assert_eq!(config["model"], "sandpit/coder-1");
        assert_eq!(config["permission"]["bash"], "ask");
        assert_eq!(l.env["OPENCODE_DISABLE_MODELS_FETCH"], "1");
        assert_eq!(l.env["XDG_DATA_HOME"], "/home/user/.sandpit/rt3/opencode");
        assert_eq!(
            l.stream,
            StreamSource::Sse {
                port: 4100,
                path: "/event".into()
            }
        );
        assert!(l.stays_up && l.permission_requests);
        assert_eq!(
            l.ready_output.as_deref(),
            Some("opencode server listening on")
        );
        let [Control::Http(create), Control::Http(prompt)] = &l.steps[..] else {
            panic!("{:?}", l.steps)
        };
        assert_eq!(
            (create.method.as_str(), create.path.as_str()),
            ("POST", "/session")
        );
        assert_eq!(create.session_from.as_deref(), Some("/id"));
        assert_eq!(prompt.path_for("ses_1"), "/session/ses_1/prompt_async");
        assert_eq!(
            prompt.body.as_ref().unwrap(),
            &json!({"parts": [{"type": "text", "text": "build the app"}],
                    "model": {"providerID": "sandpit", "modelID": "coder-1"}})
        );

        let mut s = spec();
        s.approvals = false;
        s.resume = Some(Resume::Session("ses_old".into()));
        let l = OpenCode::default().launch(&s).unwrap();
        let [Control::Http(prompt)] = &l.steps[..] else {
            panic!("{:?}", l.steps)
        };
        assert_eq!(prompt.path, "/session/ses_old/prompt_async");
        let config: Value = serde_json::from_str(&l.env["OPENCODE_CONFIG_CONTENT"]).unwrap();
        assert_eq!(config["permission"]["edit"], "allow");
        s.resume = Some(Resume::Latest);
        assert_eq!(
            OpenCode::default().launch(&s),
            Err(LaunchError::NeedsSessionId(Harness::OpenCode))
        );
        s.resume = None;
        s.model.api = WireApi::AnthropicMessages;
        assert!(matches!(
            OpenCode::default().launch(&s),
            Err(LaunchError::UnsupportedApi { .. })
        ));
    }

    #[test]
    fn a_session_maps_onto_envelope_events() {
        let mut o = OpenCode::default();
        o.session_started("ses_1");
        let input = [
            json!({"type": "server.connected", "properties": {}}),
            json!({"type": "message.updated", "properties": {"info": {"id": "msg_u", "sessionID": "ses_1", "role": "user"}}}),
            json!({"type": "message.part.updated", "properties": {"part": {"id": "prt_u", "messageID": "msg_u", "sessionID": "ses_1", "type": "text", "text": "build the app", "time": {"start": 1, "end": 1}}}}),
            json!({"type": "session.status", "properties": {"sessionID": "ses_1", "status": {"type": "busy"}}}),
            json!({"type": "message.updated", "properties": {"info": {"id": "msg_a", "sessionID": "ses_1", "role": "assistant", "time": {"created": 2}}}}),
            json!({"type": "message.part.updated", "properties": {"part": {"id": "prt_r", "messageID": "msg_a", "sessionID": "ses_1", "type": "reasoning", "text": ""}}}),
            json!({"type": "message.part.delta", "properties": {"sessionID": "ses_1", "messageID": "msg_a", "partID": "prt_r", "field": "text", "delta": "thinking"}}),
            json!({"type": "message.part.updated", "properties": {"part": {"id": "prt_t", "messageID": "msg_a", "sessionID": "ses_1", "type": "text", "text": ""}}}),
            json!({"type": "message.part.delta", "properties": {"sessionID": "ses_1", "messageID": "msg_a", "partID": "prt_t", "field": "text", "delta": "On it"}}),
            json!({"type": "message.part.updated", "properties": {"part": {"id": "prt_x", "messageID": "msg_a", "sessionID": "ses_1", "type": "tool", "callID": "call_1", "tool": "write", "state": {"status": "pending", "input": {}}}}}),
            json!({"type": "message.part.updated", "properties": {"part": {"id": "prt_x", "messageID": "msg_a", "sessionID": "ses_1", "type": "tool", "callID": "call_1", "tool": "write", "state": {"status": "running", "input": {"filePath": "/workspace/app/index.html", "content": "<h1>"}}}}}),
            json!({"type": "message.part.updated", "properties": {"part": {"id": "prt_x", "messageID": "msg_a", "sessionID": "ses_1", "type": "tool", "callID": "call_1", "tool": "write", "state": {"status": "completed", "input": {"filePath": "/workspace/app/index.html", "content": "<h1>"}, "output": "Wrote file"}}}}),
            json!({"type": "message.part.updated", "properties": {"part": {"id": "prt_x", "messageID": "msg_a", "sessionID": "ses_1", "type": "tool", "callID": "call_1", "tool": "write", "state": {"status": "completed", "input": {"filePath": "/workspace/app/index.html"}, "output": "Wrote file"}}}}),
            json!({"type": "file.edited", "properties": {"file": "/workspace/app/index.html"}}),
            json!({"type": "message.part.updated", "properties": {"part": {"id": "prt_t", "messageID": "msg_a", "sessionID": "ses_1", "type": "text", "text": "On it. Done.", "time": {"start": 3, "end": 4}}}}),
            json!({"type": "message.updated", "properties": {"info": {"id": "msg_a", "sessionID": "ses_1", "role": "assistant", "time": {"created": 2, "completed": 5},
                    "cost": 0.01, "tokens": {"input": 300, "output": 40, "reasoning": 0, "cache": {"read": 10, "write": 0}}}}}),
            json!({"type": "message.updated", "properties": {"info": {"id": "msg_a", "sessionID": "ses_1", "role": "assistant", "time": {"created": 2, "completed": 5},
                    "cost": 0.01, "tokens": {"input": 300, "output": 40}}}}),
            json!({"type": "session.status", "properties": {"sessionID": "ses_1", "status": {"type": "idle"}}}),
            json!({"type": "session.idle", "properties": {"sessionID": "ses_1"}}),
        ];
        let out: Vec<Parsed> = input.iter().map(|e| o.parse(&sse(e.clone()))).collect();
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
                EventKind::Message,
                EventKind::Usage,
            ]
        );
        assert_eq!(events[1].payload, json!({"text": "thinking"}));
        assert_eq!(events[2].payload, json!({"text": "On it"}));
        assert_eq!(
            events[3].payload,
            json!({"id": "call_1", "name": "write", "input": {"filePath": "/workspace/app/index.html", "content": "<h1>"}})
        );
        assert_eq!(events[4].payload["output"], "Wrote file");
        assert_eq!(
            events[5].payload,
            json!({"path": "/workspace/app/index.html", "change": "modified"})
        );
        assert_eq!(
            events[6].payload,
            json!({"role": "assistant", "text": "On it. Done."})
        );
        assert_eq!(
            events[7].payload,
            json!({"input_tokens": 300, "output_tokens": 40, "cache_read_tokens": 10, "cache_write_tokens": 0, "cost_usd": 0.01})
        );
        let outcomes: Vec<&Outcome> = out.iter().filter_map(|p| p.outcome.as_ref()).collect();
        assert_eq!(
            outcomes,
            [&Outcome::Succeeded {
                result: Some("On it. Done.".into())
            }]
        );
        assert!(out[17].outcome.is_some(), "the first idle ends it");
    }

    #[test]
    fn other_sessions_are_ignored_and_the_first_session_is_adopted() {
        let mut o = OpenCode::default();
        let first = o.parse(
            &json!({"type": "session.status", "properties": {"sessionID": "ses_9", "status": {"type": "busy"}}}).to_string(),
        );
        assert_eq!(first.session_id.as_deref(), Some("ses_9"));
        let other = o.parse(
            &json!({"type": "message.part.delta", "properties": {"sessionID": "ses_other", "messageID": "m", "partID": "p", "field": "text", "delta": "x"}}).to_string(),
        );
        assert_eq!(other, Parsed::default());
        // An idle before the session ever went busy does not end a run.
        let mut fresh = OpenCode::default();
        fresh.session_started("ses_1");
        let idle = fresh.parse(
            &json!({"type": "session.status", "properties": {"sessionID": "ses_1", "status": {"type": "idle"}}}).to_string(),
        );
        assert!(idle.outcome.is_none());
    }

    #[test]
    fn errors_and_aborts_decide_the_outcome() {
        let busy = json!({"type": "session.status", "properties": {"sessionID": "s", "status": {"type": "busy"}}}).to_string();
        let idle = json!({"type": "session.idle", "properties": {"sessionID": "s"}}).to_string();

        let mut o = OpenCode::default();
        o.session_started("s");
        o.parse(&busy);
        let err = o.parse(
            &json!({"type": "session.error", "properties": {"sessionID": "s", "error": {"name": "APIError", "data": {"message": "401 Unauthorized"}}}}).to_string(),
        );
        assert_eq!(err.events, [Event::error("401 Unauthorized")]);
        assert_eq!(
            o.parse(&idle).outcome,
            Some(Outcome::Failed {
                reason: "401 Unauthorized".into()
            })
        );

        let mut o = OpenCode::default();
        o.session_started("s");
        o.parse(&busy);
        let aborted = o.parse(
            &json!({"type": "message.updated", "properties": {"info": {"id": "m", "sessionID": "s", "role": "assistant",
                    "error": {"name": "MessageAbortedError", "data": {"message": "aborted"}}}}}).to_string(),
        );
        assert!(aborted.events.is_empty());
        assert_eq!(o.parse(&idle).outcome, Some(Outcome::Aborted));
        let Some(Control::Http(abort)) = o.abort(None) else {
            panic!()
        };
        assert_eq!(
            (abort.method.as_str(), abort.path.as_str()),
            ("POST", "/session/s/abort")
        );
        let Some(Control::Http(abort)) = OpenCode::default().abort(None) else {
            panic!()
        };
        assert_eq!(abort.path_for("ses_2"), "/session/ses_2/abort");
    }

    #[test]
    fn permission_asked_is_a_request_answered_over_http() {
        let mut o = OpenCode::default();
        o.session_started("ses_1");
        let out = o.parse(&sse(json!({"type": "permission.asked", "properties": {
            "id": "per_1", "sessionID": "ses_1", "permission": "bash", "patterns": ["curl *"],
            "metadata": {"command": "curl https://x.example"}, "always": ["curl *"],
            "tool": {"messageID": "msg_a", "callID": "call_2"}}})));
        let req = out.permission.unwrap();
        assert_eq!(req.id, "per_1");
        assert_eq!(req.tool, "bash");
        assert_eq!(req.call_id.as_deref(), Some("call_2"));
        assert_eq!(req.summary, "bash: curl https://x.example");
        assert_eq!(req.input["patterns"], json!(["curl *"]));
        let reply = |a: Answer| match o.answer(&req, &a) {
            Some(Control::Http(c)) => (c.path, c.body.unwrap()),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            reply(Answer::Allow { for_run: false }),
            (
                "/permission/per_1/reply".to_string(),
                json!({"reply": "once"})
            )
        );
        assert_eq!(
            reply(Answer::Allow { for_run: true }).1,
            json!({"reply": "always"})
        );
        assert_eq!(
            reply(Answer::Deny {
                message: "no".into()
            })
            .1,
            json!({"reply": "reject", "message": "no"})
        );
    }
}

#[cfg(test)]
mod more_tests {
    use super::*;

    #[test]
    fn an_edit_outside_a_tool_call_is_still_a_file_change() {
        let mut o = OpenCode::default();
        let out = o
            .parse(&json!({"type": "file.edited", "properties": {"file": "/w/b.txt"}}).to_string());
        assert_eq!(
            out.events,
            [Event::file_change("/w/b.txt", FileChange::Modified)]
        );
        let again = o
            .parse(&json!({"type": "file.edited", "properties": {"file": "/w/b.txt"}}).to_string());
        assert_eq!(
            again.events.len(),
            1,
            "a second edit of the same file is a change too"
        );
    }
}
