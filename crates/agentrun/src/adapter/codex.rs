//! Codex (`@openai/codex`), `codex exec --json`: the task is read from stdin (`-`), which
//! is then closed; out come `thread.started`, `turn.*` and `item.*` lines. The model is a
//! `[model_providers.NAME]` of `config.toml` in `CODEX_HOME` speaking the Responses API,
//! its key read from an environment variable. `exec` mode has no approval channel and no
//! in-protocol abort: cancel kills the process tree. Continuing is `exec resume ID`.
//!
//! Checked against Codex 0.171.0 with a scripted Responses model: the parser over its
//! `exec --json` stream (shell commands and an answer), the launch with the task read
//! from stdin (`-`), also after `exec resume ID`, and (through the daemon, in
//! `crates/tests/tests/agent_harnesses.rs`) a run, its continue and its cancel.

use std::collections::{BTreeMap, HashSet};

use serde_json::{Value, json};

use super::{
    Adapter, Answer, Control, Harness, Launch, LaunchError, LaunchFile, LaunchSpec, Outcome,
    Parsed, PermissionRequest, Resume, Stdin, StreamSource, WireApi, check_provider, join,
    json_or_return, str_of, string_of, u64_of,
};
use crate::event::{Event, FileChange, Usage};

/// The environment variable the generated config tells Codex to read its key from.
pub const KEY_ENV: &str = "SANDPIT_MODEL_API_KEY";

/// The Codex adapter.
#[derive(Debug, Default)]
pub struct Codex {
    /// Items whose call was announced.
    announced: HashSet<String>,
    /// The last agent message.
    last_text: Option<String>,
}

/// A TOML basic string.
fn toml_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl Codex {
    fn call(&mut self, id: Option<String>, name: String, input: Value, out: &mut Parsed) {
        let fresh = id
            .as_ref()
            .is_none_or(|id| self.announced.insert(id.clone()));
        if fresh {
            out.events.push(Event::tool_call(id, name, input));
        }
    }

    fn item(&mut self, item: &Value, completed: bool, out: &mut Parsed) {
        let id = string_of(item, "id");
        let failed = str_of(item, "status") == Some("failed");
        match str_of(item, "type").unwrap_or_default() {
            "command_execution" => {
                let command = string_of(item, "command").unwrap_or_default();
                self.call(
                    id.clone(),
                    "command_execution".into(),
                    json!({ "command": command }),
                    out,
                );
                if completed {
                    let exit = item.get("exit_code").and_then(Value::as_i64);
                    let output = string_of(item, "aggregated_output").unwrap_or_default();
                    let is_error = failed || exit.is_some_and(|c| c != 0);
                    out.events.push(Event::tool_result(
                        id,
                        Some("command_execution".into()),
                        output,
                        is_error,
                    ));
                }
            }
            "mcp_tool_call" => {
                let name = format!(
                    "{}.{}",
                    str_of(item, "server").unwrap_or("mcp"),
                    str_of(item, "tool").unwrap_or("tool")
                );
                let input = item.get("arguments").cloned().unwrap_or(Value::Null);
                self.call(id.clone(), name.clone(), input, out);
                if completed {
                    let error = item
                        .get("error")
                        .filter(|e| !e.is_null())
                        .map(|e| string_of(e, "message").unwrap_or_else(|| e.to_string()));
                    let output = match (&error, item.get("result")) {
                        (Some(e), _) => e.clone(),
                        (None, Some(r)) if !r.is_null() => r.to_string(),
                        _ => String::new(),
                    };
                    out.events.push(Event::tool_result(
                        id,
                        Some(name),
                        output,
                        failed || error.is_some(),
                    ));
                }
            }
            "web_search" => {
                let query = string_of(item, "query").unwrap_or_default();
                self.call(id, "web_search".into(), json!({ "query": query }), out);
            }
            "agent_message" if completed => {
                if let Some(text) = string_of(item, "text").filter(|t| !t.is_empty()) {
                    out.events.push(Event::message("assistant", text.clone()));
                    self.last_text = Some(text);
                }
            }
            "reasoning" if completed => {
                if let Some(text) = string_of(item, "text").filter(|t| !t.is_empty()) {
                    out.events.push(Event::reasoning_delta(text));
                }
            }
            "file_change" if completed && !failed => {
                for change in item
                    .get("changes")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let Some(path) = string_of(change, "path") else {
                        continue;
                    };
                    let how = match str_of(change, "kind") {
                        Some("add") => FileChange::Created,
                        Some("delete") => FileChange::Deleted,
                        _ => FileChange::Modified,
                    };
                    out.events.push(Event::file_change(path, how));
                }
            }
            "error" if completed => {
                out.events.push(Event::error(
                    string_of(item, "message").unwrap_or_else(|| "error".into()),
                ));
            }
            _ => {}
        }
    }
}

impl Adapter for Codex {
    fn harness(&self) -> Harness {
        Harness::Codex
    }

    fn launch(&self, spec: &LaunchSpec) -> Result<Launch, LaunchError> {
        let m = &spec.model;
        if m.api != WireApi::Responses {
            return Err(LaunchError::UnsupportedApi {
                harness: Harness::Codex,
                api: m.api,
            });
        }
        check_provider(&m.provider)?;
        let home = join(&spec.state_dir, "codex");
        let config = format!(
            // No update check or analytics: nothing but the model is to be reached.
            "model = {model}\nmodel_provider = {provider}\ncheck_for_update_on_startup = false\n\n\
             [analytics]\nenabled = false\n\n[model_providers.{name}]\n\
             name = {provider}\nbase_url = {url}\nenv_key = {key}\nwire_api = \"responses\"\n",
            model = toml_str(&m.model),
            provider = toml_str(&m.provider),
            name = m.provider,
            url = toml_str(&m.base_url),
            key = toml_str(KEY_ENV),
        );
        let program = spec.program.clone().unwrap_or_else(|| "codex".into());
        let mut argv: Vec<String> = [
            program.as_str(),
            "exec",
            "--json",
            "--skip-git-repo-check",
            // sandpit's sandbox is the boundary; Codex's own cannot nest inside it.
            "-s",
            "danger-full-access",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        match &spec.resume {
            Some(Resume::Session(id)) => argv.extend(["resume".into(), id.clone()]),
            Some(Resume::Latest) => argv.extend(["resume".into(), "--last".into()]),
            None => {}
        }
        // The task comes on stdin, so no text of it can be taken for an option.
        argv.push("-".into());
        let env = BTreeMap::from([
            ("CODEX_HOME".to_string(), home.clone()),
            (KEY_ENV.to_string(), m.api_key.clone()),
        ]);
        Ok(Launch {
            argv,
            env,
            files: vec![LaunchFile {
                path: join(&home, "config.toml"),
                contents: config,
                mode: 0o600,
            }],
            cwd: spec.workdir.clone(),
            stdin: Stdin::Input,
            stream: StreamSource::Stdout,
            steps: vec![Control::StdinLine(spec.task.clone())],
            permission_requests: false,
            stays_up: false,
            ready_output: None,
        })
    }

    fn abort(&self, _session_id: Option<&str>) -> Option<Control> {
        None
    }

    fn answer(&self, _request: &PermissionRequest, _answer: &Answer) -> Option<Control> {
        None
    }

    fn parse(&mut self, input: &str) -> Parsed {
        let v = json_or_return!(input);
        let mut out = Parsed::default();
        match str_of(&v, "type").unwrap_or_default() {
            "thread.started" => out.session_id = string_of(&v, "thread_id"),
            "turn.started" => out.events.push(Event::status("busy", None)),
            "item.started" | "item.updated" => {
                self.item(v.get("item").unwrap_or(&Value::Null), false, &mut out)
            }
            "item.completed" => self.item(v.get("item").unwrap_or(&Value::Null), true, &mut out),
            "turn.completed" => {
                let u = v.get("usage").unwrap_or(&Value::Null);
                let usage = Usage {
                    input_tokens: u64_of(u, "input_tokens"),
                    output_tokens: u64_of(u, "output_tokens"),
                    cache_read_tokens: u64_of(u, "cached_input_tokens"),
                    cache_write_tokens: None,
                    cost_usd: None,
                };
                if !usage.is_empty() {
                    out.events.push(Event::usage(&usage));
                }
                out.outcome = Some(Outcome::Succeeded {
                    result: self.last_text.clone(),
                });
            }
            "turn.failed" => {
                let reason = v
                    .get("error")
                    .and_then(|e| string_of(e, "message"))
                    .unwrap_or_else(|| "turn failed".into());
                out.events.push(Event::error(reason.clone()));
                out.outcome = Some(Outcome::Failed { reason });
            }
            "error" => out.events.push(Event::error(
                string_of(&v, "message").unwrap_or_else(|| "error".into()),
            )),
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
            task: "-n: a task that looks like a flag".into(),
            model: ModelEndpoint {
                provider: "sandpit".into(),
                api: WireApi::Responses,
                base_url: "https://models.example/v1".into(),
                model: "gpt-test".into(),
                api_key: "sandpit-placeholder-4".into(),
            },
            workdir: "/workspace".into(),
            state_dir: "/home/user/.sandpit/rt4".into(),
            resume: None,
            approvals: true,
            program: None,
        }
    }

    #[test]
    fn the_launch_writes_a_provider_config_and_reads_the_task_from_stdin() {
        let l = Codex::default().launch(&spec()).unwrap();
        assert_eq!(
            l.argv,
            [
                "codex",
                "exec",
                "--json",
                "--skip-git-repo-check",
                "-s",
                "danger-full-access",
                "-"
            ]
        );
        assert_eq!(l.env["CODEX_HOME"], "/home/user/.sandpit/rt4/codex");
        assert_eq!(l.env[KEY_ENV], "sandpit-placeholder-4");
        assert_eq!(l.files[0].path, "/home/user/.sandpit/rt4/codex/config.toml");
        assert_eq!(
            l.files[0].contents,
            "model = \"gpt-test\"\nmodel_provider = \"sandpit\"\ncheck_for_update_on_startup = false\n\n\
             [analytics]\nenabled = false\n\n[model_providers.sandpit]\n\
             name = \"sandpit\"\nbase_url = \"https://models.example/v1\"\n\
             env_key = \"SANDPIT_MODEL_API_KEY\"\nwire_api = \"responses\"\n"
        );
        assert!(!l.files[0].contents.contains("placeholder"));
        assert_eq!(l.stdin, Stdin::Input);
        assert_eq!(
            l.steps,
            [Control::StdinLine(
                "-n: a task that looks like a flag".into()
            )]
        );
        assert!(!l.permission_requests, "exec mode asks nothing");
        assert_eq!(Codex::default().abort(Some("t")), None);

        let mut s = spec();
        s.resume = Some(Resume::Session("0199-thread".into()));
        let l = Codex::default().launch(&s).unwrap();
        assert_eq!(l.argv[6..], ["resume", "0199-thread", "-"]);
        s.resume = Some(Resume::Latest);
        let l = Codex::default().launch(&s).unwrap();
        assert_eq!(l.argv[6..], ["resume", "--last", "-"]);
        s.model.api = WireApi::ChatCompletions;
        assert!(Codex::default().launch(&s).is_err());
        assert_eq!(toml_str("a\"b\\c\n\u{1}"), "\"a\\\"b\\\\c\\n\\u0001\"");
    }

    #[test]
    fn an_exec_stream_maps_onto_envelope_events() {
        let mut c = Codex::default();
        let input = [
            json!({"type": "thread.started", "thread_id": "0199a-thread"}),
            json!({"type": "turn.started"}),
            json!({"type": "item.completed", "item": {"id": "item_0", "type": "reasoning", "text": "**Planning**"}}),
            json!({"type": "item.started", "item": {"id": "item_1", "type": "command_execution", "command": "bash -lc ls", "aggregated_output": "", "exit_code": null, "status": "in_progress"}}),
            json!({"type": "item.completed", "item": {"id": "item_1", "type": "command_execution", "command": "bash -lc ls", "aggregated_output": "a.txt\n", "exit_code": 0, "status": "completed"}}),
            json!({"type": "item.completed", "item": {"id": "item_2", "type": "command_execution", "command": "false", "aggregated_output": "", "exit_code": 1, "status": "failed"}}),
            json!({"type": "item.completed", "item": {"id": "item_3", "type": "file_change", "status": "completed",
                   "changes": [{"path": "/w/new.txt", "kind": "add"}, {"path": "/w/a.txt", "kind": "update"}, {"path": "/w/old.txt", "kind": "delete"}]}}),
            json!({"type": "item.completed", "item": {"id": "item_4", "type": "agent_message", "text": "All done."}}),
            json!({"type": "turn.completed", "usage": {"input_tokens": 900, "cached_input_tokens": 100, "output_tokens": 60}}),
        ];
        let out: Vec<Parsed> = input.iter().map(|l| c.parse(&l.to_string())).collect();
        assert_eq!(out[0].session_id.as_deref(), Some("0199a-thread"));
        let events: Vec<&Event> = out.iter().flat_map(|p| &p.events).collect();
        let kinds: Vec<EventKind> = events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [
                EventKind::Status,
                EventKind::ReasoningDelta,
                EventKind::ToolCall,
                EventKind::ToolResult,
                EventKind::ToolCall,
                EventKind::ToolResult,
                EventKind::FileChange,
                EventKind::FileChange,
                EventKind::FileChange,
                EventKind::Message,
                EventKind::Usage,
            ]
        );
        assert_eq!(
            events[2].payload,
            json!({"id": "item_1", "name": "command_execution", "input": {"command": "bash -lc ls"}})
        );
        assert_eq!(events[3].payload["output"], "a.txt\n");
        assert_eq!(events[3].payload["is_error"], false);
        assert_eq!(events[5].payload["is_error"], true);
        let changes: Vec<(&str, &str)> = events[6..9]
            .iter()
            .map(|e| {
                (
                    e.payload["path"].as_str().unwrap(),
                    e.payload["change"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            changes,
            [
                ("/w/new.txt", "created"),
                ("/w/a.txt", "modified"),
                ("/w/old.txt", "deleted")
            ]
        );
        assert_eq!(
            events[10].payload,
            json!({"input_tokens": 900, "output_tokens": 60, "cache_read_tokens": 100})
        );
        assert_eq!(
            out[8].outcome,
            Some(Outcome::Succeeded {
                result: Some("All done.".into())
            })
        );
    }

    #[test]
    fn failures_and_tool_calls_of_other_kinds() {
        let mut c = Codex::default();
        let failed = c.parse(
            &json!({"type": "turn.failed", "error": {"message": "stream disconnected"}})
                .to_string(),
        );
        assert_eq!(
            failed.outcome,
            Some(Outcome::Failed {
                reason: "stream disconnected".into()
            })
        );
        let err = c.parse(&json!({"type": "error", "message": "reconnecting 1/5"}).to_string());
        assert_eq!(err.events, [Event::error("reconnecting 1/5")]);
        assert!(err.outcome.is_none());
        let mcp = c.parse(
            &json!({"type": "item.completed", "item": {"id": "i9", "type": "mcp_tool_call", "server": "docs", "tool": "search",
                    "arguments": {"q": "x"}, "result": null, "error": {"message": "timeout"}, "status": "failed"}})
            .to_string(),
        );
        assert_eq!(mcp.events[0].payload["name"], "docs.search");
        assert_eq!(mcp.events[1].payload["output"], "timeout");
        assert_eq!(mcp.events[1].payload["is_error"], true);
        assert!(c.parse("Reading prompt from stdin...").unrecognized);
    }
}
