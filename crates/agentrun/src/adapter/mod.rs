//! Harness adapters: one [`Adapter`] per coding-agent harness, behind one trait.
//!
//! An adapter is a parser with a little state (which tool call wrote which file, whether
//! the session went busy) plus a description, as data, of how to drive the harness
//! headless: the [`Launch`] (argv, env, files, what to send first, where its events come
//! out), how to abort it in its own protocol, and how to answer its permission requests.
//! It runs nothing itself. Make a fresh adapter per run.
//!
//! The model's API key in a [`ModelEndpoint`] is meant to be the broker's placeholder: the
//! launch writes it where the harness reads its key (env or config file), and the broker
//! swaps in the real key on the way out of the sandbox.
//!
//! What [`Adapter::parse`] returns is the harness's own text, unredacted: pass every event
//! through [`crate::sanitize`] (and a [`PermissionRequest`]'s summary through
//! [`crate::Redactor::redact_text`]) before storing it.

mod claude;
mod codex;
mod opencode;
mod pi;

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::event::Event;

pub use claude::Claude;
pub use codex::Codex;
pub use opencode::OpenCode;
pub use pi::Pi;

/// A coding-agent harness sandpit can drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Harness {
    /// `pi` (`@mariozechner/pi-coding-agent`), in RPC mode.
    Pi,
    /// `opencode` (`opencode-ai`), through `opencode serve`.
    OpenCode,
    /// Claude Code (`@anthropic-ai/claude-code`), `-p` with stream-json in and out.
    Claude,
    /// Codex (`@openai/codex`), `codex exec --json`.
    Codex,
}

impl Harness {
    /// Every harness.
    pub const ALL: [Harness; 4] = [
        Harness::Pi,
        Harness::OpenCode,
        Harness::Claude,
        Harness::Codex,
    ];

    /// Its name in the API and the store.
    pub fn as_str(self) -> &'static str {
        match self {
            Harness::Pi => "pi",
            Harness::OpenCode => "opencode",
            Harness::Claude => "claude",
            Harness::Codex => "codex",
        }
    }

    /// The executable's usual name.
    pub fn program(self) -> &'static str {
        self.as_str()
    }

    /// The wire API a model endpoint is taken to speak when a runtime names none: the one
    /// the harness is built around.
    pub fn default_api(self) -> WireApi {
        match self {
            Harness::Pi | Harness::OpenCode => WireApi::ChatCompletions,
            Harness::Claude => WireApi::AnthropicMessages,
            Harness::Codex => WireApi::Responses,
        }
    }

    /// Whether the harness, run headless as sandpit runs it, can put its tool use to sandpit
    /// for approval (a launch with [`LaunchSpec::approvals`] then sets
    /// [`Launch::permission_requests`]). Codex `exec` cannot: only its `app-server` asks.
    pub fn can_ask_permission(self) -> bool {
        match self {
            Harness::Pi | Harness::OpenCode | Harness::Claude => true,
            Harness::Codex => false,
        }
    }

    /// Whether the harness can talk to a model endpoint speaking `api` (the launch of an
    /// adapter refuses the others with [`LaunchError::UnsupportedApi`]).
    pub fn speaks(self, api: WireApi) -> bool {
        match self {
            Harness::Pi => true,
            Harness::OpenCode => api == WireApi::ChatCompletions,
            Harness::Claude => api == WireApi::AnthropicMessages,
            Harness::Codex => api == WireApi::Responses,
        }
    }
}

impl fmt::Display for Harness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Harness {
    type Err = LaunchError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Harness::ALL
            .into_iter()
            .find(|h| h.as_str() == s)
            .ok_or_else(|| LaunchError::UnknownHarness(s.to_string()))
    }
}

/// The wire API a model endpoint speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireApi {
    /// OpenAI Chat Completions (`POST {base_url}/chat/completions`).
    ChatCompletions,
    /// OpenAI Responses (`POST {base_url}/responses`).
    Responses,
    /// Anthropic Messages (`POST {base_url}/v1/messages`).
    AnthropicMessages,
}

impl WireApi {
    /// Its name in errors and config.
    pub fn as_str(self) -> &'static str {
        match self {
            WireApi::ChatCompletions => "chat_completions",
            WireApi::Responses => "responses",
            WireApi::AnthropicMessages => "anthropic_messages",
        }
    }
}

/// Where the harness reaches its model.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelEndpoint {
    /// The provider's name in the harness's config (a word: letters, digits, `-`, `_`).
    pub provider: String,
    /// The wire API it speaks.
    pub api: WireApi,
    /// The URL the API's paths are relative to: for the OpenAI APIs the one ending in
    /// `/v1` (before `/chat/completions`), for Anthropic the one before `/v1/messages`.
    pub base_url: String,
    /// The model id to ask for.
    pub model: String,
    /// The key the harness sends: the broker's placeholder, not the real key.
    pub api_key: String,
}

impl fmt::Debug for ModelEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelEndpoint")
            .field("provider", &self.provider)
            .field("api", &self.api)
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

/// Which harness session a `continue` run resumes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resume {
    /// This session (the id the adapter reported in [`Parsed::session_id`]).
    Session(String),
    /// The harness's most recent session in its state directory.
    Latest,
}

/// What a launch needs to know.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchSpec {
    /// The task (the run's prompt).
    pub task: String,
    /// The model endpoint.
    pub model: ModelEndpoint,
    /// The directory the harness works in.
    pub workdir: String,
    /// A directory of the runtime's own for the harness's config and sessions; it must
    /// outlive the run for `continue` to find the session (and, for Codex, not be under
    /// `/tmp`).
    pub state_dir: String,
    /// Continue a session instead of starting a new one.
    pub resume: Option<Resume>,
    /// Route the harness's own permission requests to sandpit (see
    /// [`Launch::permission_requests`]); without it the harness runs its tools unasked.
    pub approvals: bool,
    /// The executable, when not the harness's usual name on `PATH`.
    pub program: Option<String>,
}

/// A file to write (mode `mode`) before starting the harness.
#[derive(Clone, PartialEq, Eq)]
pub struct LaunchFile {
    /// Absolute path inside the sandbox.
    pub path: String,
    /// Its contents.
    pub contents: String,
    /// Unix permission bits.
    pub mode: u32,
}

impl fmt::Debug for LaunchFile {
    // Config files carry the (placeholder) key; keep them out of logs all the same.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaunchFile")
            .field("path", &self.path)
            .field("bytes", &self.contents.len())
            .field("mode", &format_args!("{:o}", self.mode))
            .finish()
    }
}

/// What the harness's standard input is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stdin {
    /// Closed from the start.
    Closed,
    /// Kept open for [`Control::StdinLine`] messages; close it once the outcome is seen
    /// (the harness then exits).
    Lines,
    /// The steps' lines are the whole input: write them, then close it.
    Input,
    /// Not used (left open, or `/dev/null`).
    Unused,
}

/// Where the harness's events come out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamSource {
    /// One JSON object per line on standard output.
    Stdout,
    /// Server-sent events from the harness's HTTP server on loopback inside the sandbox;
    /// subscribe before sending [`Launch::steps`] so nothing is missed.
    Sse {
        /// Its port.
        port: u16,
        /// The event stream's path.
        path: String,
    },
}

/// A path segment standing for the harness session id in [`HttpCall::path`]: the id a
/// step's [`HttpCall::session_from`] found, or the one given to resume.
pub const SESSION_PLACEHOLDER: &str = "{session}";

/// One HTTP request to the harness's own server (on loopback, port of the launch).
#[derive(Debug, Clone, PartialEq)]
pub struct HttpCall {
    /// Method.
    pub method: String,
    /// Path, possibly containing [`SESSION_PLACEHOLDER`].
    pub path: String,
    /// JSON body.
    pub body: Option<Value>,
    /// JSON pointer into the response naming the harness session id (report it to
    /// [`Adapter::session_started`]).
    pub session_from: Option<String>,
}

impl HttpCall {
    /// The path with [`SESSION_PLACEHOLDER`] replaced by `session`.
    pub fn path_for(&self, session: &str) -> String {
        self.path.replace(SESSION_PLACEHOLDER, session)
    }
}

/// One message to the harness in its own protocol.
#[derive(Debug, Clone, PartialEq)]
pub enum Control {
    /// A line (without its newline) to write to its standard input.
    StdinLine(String),
    /// A request to its HTTP server.
    Http(HttpCall),
}

/// How to run a harness headless, as data.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Environment to add.
    pub env: BTreeMap<String, String>,
    /// Files to write first.
    pub files: Vec<LaunchFile>,
    /// Working directory.
    pub cwd: String,
    /// What standard input is for.
    pub stdin: Stdin,
    /// Where the events come out.
    pub stream: StreamSource,
    /// What to send, in order, once the harness is up (and, for SSE, subscribed to).
    pub steps: Vec<Control>,
    /// Whether the harness will ask permission through its protocol
    /// ([`Parsed::permission`]) for sandpit to answer.
    pub permission_requests: bool,
    /// Whether the process stays up after the outcome (a server); stop it when done.
    pub stays_up: bool,
    /// Text the harness prints on standard output once it accepts requests; wait for it
    /// before subscribing and sending the steps.
    pub ready_output: Option<String>,
}

/// Why a launch cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// No such harness.
    #[error("unknown harness {0:?}")]
    UnknownHarness(String),
    /// The harness does not speak the endpoint's wire API.
    #[error("{harness} cannot use a {} model endpoint", api.as_str())]
    UnsupportedApi {
        /// The harness.
        harness: Harness,
        /// The endpoint's API.
        api: WireApi,
    },
    /// The harness can only resume a session it is told the id of.
    #[error("{0} needs the session id to continue")]
    NeedsSessionId(Harness),
    /// The provider name would not fit the harness's config.
    #[error("provider name {0:?} must be letters, digits, '-' or '_'")]
    BadProvider(String),
}

/// How a harness finished a run, as it reported it.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Done; the final answer when it gave one.
    Succeeded {
        /// Its final text.
        result: Option<String>,
    },
    /// It gave up or failed.
    Failed {
        /// Why, in its words.
        reason: String,
    },
    /// It stopped on an abort.
    Aborted,
}

/// The harness asks permission to use a tool; answer with [`Adapter::answer`].
#[derive(Debug, Clone, PartialEq)]
pub struct PermissionRequest {
    /// The harness's id of the request.
    pub id: String,
    /// The tool (or permission) it wants.
    pub tool: String,
    /// The tool's input, as the harness gives it.
    pub input: Value,
    /// The tool call it belongs to, when known.
    pub call_id: Option<String>,
    /// One line for the approver (unredacted).
    pub summary: String,
}

/// An answer to a [`PermissionRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Let it through; `for_run` lets the same tool through from now on where the harness
    /// can remember it (sandpit's standing grant covers the others).
    Allow {
        /// Remember it for the rest of the session.
        for_run: bool,
    },
    /// Refuse, with a message the agent sees.
    Deny {
        /// Why.
        message: String,
    },
}

/// What one line (or SSE event) of harness output gave.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parsed {
    /// Envelope events, in order.
    pub events: Vec<Event>,
    /// The harness's session id, when this input revealed it.
    pub session_id: Option<String>,
    /// A permission request to put to a person.
    pub permission: Option<PermissionRequest>,
    /// How the run ended, when this input says.
    pub outcome: Option<Outcome>,
    /// The input was not the JSON the harness should print (a stray log line).
    pub unrecognized: bool,
}

impl Parsed {
    fn unrecognized() -> Parsed {
        Parsed {
            unrecognized: true,
            ..Parsed::default()
        }
    }
}

/// One harness: its launch as data, and the parser of its output.
pub trait Adapter: Send {
    /// Which harness.
    fn harness(&self) -> Harness;

    /// How to start it for `spec`.
    fn launch(&self, spec: &LaunchSpec) -> Result<Launch, LaunchError>;

    /// How to stop the current work in its own protocol (then kill the process tree
    /// anyway: every harness leaves its tools' children behind); `None` when it has no
    /// such message.
    fn abort(&self, session_id: Option<&str>) -> Option<Control>;

    /// How to answer one of its permission requests; `None` if it asks none.
    fn answer(&self, request: &PermissionRequest, answer: &Answer) -> Option<Control>;

    /// Tells the adapter the session id a launch step's response named.
    fn session_started(&mut self, _session_id: &str) {}

    /// Reads one line of its output (or one SSE event: its `data:` lines, or the JSON
    /// itself).
    fn parse(&mut self, input: &str) -> Parsed;
}

/// A new adapter for `harness`, with default settings.
pub fn adapter(harness: Harness) -> Box<dyn Adapter> {
    match harness {
        Harness::Pi => Box::new(Pi::default()),
        Harness::OpenCode => Box::new(OpenCode::default()),
        Harness::Claude => Box::new(Claude::default()),
        Harness::Codex => Box::new(Codex::default()),
    }
}

// Helpers shared by the adapters.

/// One line of a harness's JSON output.
pub(crate) enum Line {
    /// Nothing on it.
    Blank,
    /// A JSON object.
    Json(Value),
    /// Anything else (a stray log line).
    Junk,
}

/// Reads one line of JSON output.
pub(crate) fn parse_line(input: &str) -> Line {
    let line = input.trim();
    if line.is_empty() {
        return Line::Blank;
    }
    match serde_json::from_str::<Value>(line) {
        Ok(v) if v.is_object() => Line::Json(v),
        _ => Line::Junk,
    }
}

/// The JSON of one line, or the early return for the others.
macro_rules! json_or_return {
    ($input:expr) => {
        match $crate::adapter::parse_line($input) {
            $crate::adapter::Line::Json(v) => v,
            $crate::adapter::Line::Blank => return $crate::adapter::Parsed::default(),
            $crate::adapter::Line::Junk => return $crate::adapter::Parsed::unrecognized(),
        }
    };
}
pub(crate) use json_or_return;

/// The string at `key` of an object.
pub(crate) fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// The string at `key`, owned.
pub(crate) fn string_of(v: &Value, key: &str) -> Option<String> {
    str_of(v, key).map(str::to_string)
}

/// A u64 at `key`.
pub(crate) fn u64_of(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

/// Text of a content value: a string, or the `text` of every text block of an array.
pub(crate) fn content_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter(|b| str_of(b, "type").is_none_or(|t| t == "text"))
            .filter_map(|b| str_of(b, "text"))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// One line an approver can read: the tool and its command, path, or input.
pub(crate) fn summarize(tool: &str, input: &Value) -> String {
    const MAX: usize = 200;
    let detail = ["command", "file_path", "filePath", "path", "url", "pattern"]
        .iter()
        .find_map(|k| str_of(input, k).map(str::to_string))
        .unwrap_or_else(|| match input {
            Value::Null => String::new(),
            other => other.to_string(),
        });
    let mut line = if detail.is_empty() {
        tool.to_string()
    } else {
        format!("{tool}: {detail}")
    };
    crate::limits::truncate_string(&mut line, MAX);
    line
}

/// Checks a provider name is a plain word, as config keys and `--provider` need.
pub(crate) fn check_provider(name: &str) -> Result<(), LaunchError> {
    let ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(LaunchError::BadProvider(name.to_string()))
    }
}

/// `state_dir/rest` without a doubled slash.
pub(crate) fn join(dir: &str, rest: &str) -> String {
    format!("{}/{rest}", dir.trim_end_matches('/'))
}

/// The data of one SSE event (its `data:` lines joined), or the input itself when it is
/// not in SSE form.
pub(crate) fn sse_data(input: &str) -> String {
    if !input.lines().any(|l| l.starts_with("data:")) {
        return input.to_string();
    }
    input
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Tool names that write the file named in their input.
pub(crate) fn written_path(tool: &str, input: &Value) -> Option<String> {
    let writes = matches!(
        tool,
        "write" | "edit" | "Write" | "Edit" | "MultiEdit" | "NotebookEdit" | "multiedit"
    );
    if !writes {
        return None;
    }
    ["file_path", "filePath", "path", "notebook_path"]
        .iter()
        .find_map(|k| string_of(input, k))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn harness_names_round_trip() {
        for h in Harness::ALL {
            assert_eq!(h.as_str().parse::<Harness>().unwrap(), h);
            assert_eq!(adapter(h).harness(), h);
        }
        assert_eq!(
            "gemini".parse::<Harness>(),
            Err(LaunchError::UnknownHarness("gemini".into()))
        );
    }

    #[test]
    fn each_harness_speaks_its_default_api_and_its_launch_agrees_with_speaks() {
        let apis = [
            WireApi::ChatCompletions,
            WireApi::Responses,
            WireApi::AnthropicMessages,
        ];
        for h in Harness::ALL {
            assert!(h.speaks(h.default_api()), "{h}");
            for api in apis {
                let spec = LaunchSpec {
                    task: "t".into(),
                    model: ModelEndpoint {
                        provider: "p".into(),
                        api,
                        base_url: "http://m.example/v1".into(),
                        model: "m".into(),
                        api_key: "k".into(),
                    },
                    workdir: "/w".into(),
                    state_dir: "/home/user/s".into(),
                    resume: None,
                    approvals: false,
                    program: None,
                };
                let refused = matches!(
                    adapter(h).launch(&spec),
                    Err(LaunchError::UnsupportedApi { .. })
                );
                assert_eq!(refused, !h.speaks(api), "{h} with {}", api.as_str());
            }
        }
        assert_eq!(Harness::Claude.default_api(), WireApi::AnthropicMessages);
        assert_eq!(Harness::Codex.default_api(), WireApi::Responses);
        assert_eq!(Harness::Pi.default_api(), WireApi::ChatCompletions);
    }

    #[test]
    fn a_harness_that_can_ask_launches_asking_and_codex_cannot() {
        for h in Harness::ALL {
            let spec = LaunchSpec {
                task: "t".into(),
                model: ModelEndpoint {
                    provider: "p".into(),
                    api: h.default_api(),
                    base_url: "http://m.example/v1".into(),
                    model: "m".into(),
                    api_key: "k".into(),
                },
                workdir: "/w".into(),
                state_dir: "/home/user/s".into(),
                resume: None,
                approvals: true,
                program: None,
            };
            let launch = adapter(h).launch(&spec).unwrap();
            assert_eq!(launch.permission_requests, h.can_ask_permission(), "{h}");
        }
        assert!(!Harness::Codex.can_ask_permission());
    }

    #[test]
    fn sse_events_and_plain_json_read_the_same() {
        assert_eq!(sse_data("event: message\ndata: {\"a\":1}\n"), "{\"a\":1}");
        assert_eq!(sse_data("data:{\"a\":\ndata: 1}"), "{\"a\":\n1}");
        assert_eq!(sse_data("{\"a\":1}"), "{\"a\":1}");
    }

    #[test]
    fn summaries_name_the_tool_and_what_it_touches() {
        assert_eq!(
            summarize("bash", &json!({"command": "ls -la"})),
            "bash: ls -la"
        );
        assert_eq!(
            summarize("Write", &json!({"file_path": "/w/a"})),
            "Write: /w/a"
        );
        assert_eq!(summarize("x", &json!({"n": 1})), "x: {\"n\":1}");
        assert_eq!(summarize("x", &Value::Null), "x");
        let long = summarize("bash", &json!({"command": "y".repeat(500)}));
        assert!(long.len() < 260 && long.contains("…[truncated"), "{long}");
    }

    #[test]
    fn model_endpoint_debug_hides_the_key() {
        let m = ModelEndpoint {
            provider: "p".into(),
            api: WireApi::ChatCompletions,
            base_url: "https://m.example/v1".into(),
            model: "m".into(),
            api_key: "placeholder-key-123".into(),
        };
        assert!(!format!("{m:?}").contains("placeholder-key-123"));
    }
}
