//! The two wire formats of the code interpreter: the line protocol between the agent and a
//! worker process, and the NDJSON lines an `execute` response streams to the client (in
//! the shape the E2B code-interpreter SDK parses).
//!
//! Agent → python/javascript worker, fd 3: the worker program as one JSON string line,
//! then `{"op":"exec","code","env","token"}` lines. Agent → bash worker: four
//! NUL-terminated fields on fd 3 (token, env prelude, code, env postlude) and
//! [`BASH_RUN_LINE`] on stdin. Worker → agent, fd 4: JSON lines tagged `ev` (`ready`,
//! `start`, `result`, `error`, `done`). A cell's stdout and stderr arrive raw on fds 1
//! and 2, each ending with the cell's token.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// A context asked for a language the interpreter does not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("language {name:?} is not supported here (supported: python, javascript, bash)")]
pub struct UnsupportedLanguage {
    /// The name as asked for, trimmed and lowercased.
    pub name: String,
}

/// Languages a context can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Language {
    Python,
    JavaScript,
    Bash,
}

impl Language {
    /// Parses the `language` field of a request; `None`/empty means Python.
    pub fn parse(name: Option<&str>) -> Result<Language, UnsupportedLanguage> {
        match name.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
            None | Some("") | Some("python") | Some("python3") => Ok(Language::Python),
            Some("javascript") | Some("js") | Some("node") => Ok(Language::JavaScript),
            Some("bash") | Some("sh") | Some("shell") => Ok(Language::Bash),
            Some(other) => Err(UnsupportedLanguage {
                name: other.to_string(),
            }),
        }
    }

    /// The name reported in context JSON.
    pub fn name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::JavaScript => "javascript",
            Language::Bash => "bash",
        }
    }
}

/// The line bash reads on stdin to run the cell whose fields wait on fd 3. The cell sees
/// neither the agent's pipes nor stdin; its redirections are undone after it.
pub const BASH_RUN_LINE: &[u8] = b"__sp_begin && eval \"$__sp_code\" </dev/null 3<&- 4>&-\n";

/// A command for a python or javascript worker.
#[derive(Debug, Serialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Command<'a> {
    /// Run one cell with extra environment variables set for its duration.
    Exec {
        code: &'a str,
        env: &'a BTreeMap<String, String>,
        token: &'a str,
    },
}

impl Command<'_> {
    /// The command as one line.
    pub fn to_line(&self) -> Vec<u8> {
        // Serializing plain strings and a string map cannot fail.
        let mut line = serde_json::to_vec(self).unwrap_or_default();
        line.push(b'\n');
        line
    }
}

/// The first line a python or javascript worker reads: its own program.
pub fn program_line(source: &str) -> Vec<u8> {
    let mut line = serde_json::to_vec(source).unwrap_or_default();
    line.push(b'\n');
    line
}

/// An event a worker reports on fd 4.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "ev", rename_all = "lowercase")]
pub enum Event {
    /// Started and waiting for cells.
    Ready,
    /// Read the cell and is about to run it: from now on SIGINT interrupts it.
    Start,
    /// A result: the main one or a display.
    Result { data: Map<String, Value> },
    /// The cell raised.
    Error {
        name: String,
        value: String,
        traceback: String,
    },
    /// The cell finished; its token was written to stdout and stderr before this.
    Done {
        token: String,
        #[serde(default)]
        status: i32,
    },
}

/// Parses one event line; `None` for anything that is not one (the worker is user code's
/// process, so its fd 4 may carry garbage).
pub fn parse_event(line: &[u8]) -> Option<Event> {
    serde_json::from_slice(line).ok()
}

/// Characters allowed in an environment variable name of a cell (bash needs identifiers).
pub fn valid_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
        && name.len() <= 256
}

/// Quotes a string for bash so that it stays one literal word.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The fd-3 fields of one bash cell. The prelude exports `env` and remembers what it
/// replaced; the postlude puts that back. Fails on NUL bytes, which cannot be framed.
pub fn bash_frame(
    token: &str,
    env: &BTreeMap<String, String>,
    code: &str,
) -> Result<Vec<u8>, String> {
    let mut pre = String::new();
    let mut post = String::new();
    for (i, (k, v)) in env.iter().enumerate() {
        if !valid_env_name(k) {
            return Err(format!("invalid environment variable name {k:?}"));
        }
        pre.push_str(&format!(
            "__sp_s{i}=${{{k}+x}}; __sp_o{i}=${{{k}-}}; export {k}={}\n",
            shell_quote(v)
        ));
        post.push_str(&format!(
            "if [ -n \"$__sp_s{i}\" ]; then export {k}=\"$__sp_o{i}\"; else unset {k}; fi; unset __sp_s{i} __sp_o{i}\n"
        ));
    }
    let mut out = Vec::new();
    for field in [token, &pre, code, &post] {
        if field.contains('\0') {
            return Err("code and environment must not contain NUL bytes".into());
        }
        out.extend_from_slice(field.as_bytes());
        out.push(0);
    }
    Ok(out)
}

/// A fresh end-of-cell token: printable, never in JSON escapes, unlikely in real output.
pub fn new_token() -> String {
    format!("__sandpit_end_{}__", uuid::Uuid::new_v4().simple())
}

/// Output bytes held back before they are sent without a newline.
pub const MAX_PENDING: usize = 64 * 1024;

/// Turns one raw output stream of a cell into text messages: whole lines as soon as they
/// are complete, partial lines on [`flush`](Self::flush), and nothing from the cell's
/// token on.
#[derive(Debug)]
pub struct OutputSplitter {
    buf: Vec<u8>,
    token: Vec<u8>,
    seen: bool,
}

impl OutputSplitter {
    /// A splitter waiting for `token`.
    pub fn new(token: &str) -> Self {
        Self {
            buf: Vec::new(),
            token: token.as_bytes().to_vec(),
            seen: false,
        }
    }

    /// Whether the token (or the end of the stream) was seen.
    pub fn done(&self) -> bool {
        self.seen
    }

    /// Whether bytes are waiting for a newline.
    pub fn pending(&self) -> bool {
        !self.buf.is_empty()
    }

    /// The stream ended: whatever is held is all there is.
    pub fn end(&mut self) -> Option<String> {
        self.seen = true;
        take_text(&mut self.buf, usize::MAX)
    }

    /// Adds bytes read from the stream; returns the text now ready to send.
    pub fn push(&mut self, data: &[u8]) -> Option<String> {
        if self.seen {
            // After the token: a background process's output between cells.
            return None;
        }
        self.buf.extend_from_slice(data);
        if let Some(pos) = find(&self.buf, &self.token) {
            self.buf.truncate(pos);
            self.seen = true;
            return take_text(&mut self.buf, usize::MAX);
        }
        if let Some(nl) = self.buf.iter().rposition(|b| *b == b'\n') {
            return take_text(&mut self.buf, nl + 1);
        }
        if self.buf.len() > MAX_PENDING {
            return self.flush();
        }
        None
    }

    /// Sends a partial line, keeping back what may be the start of the token or of a
    /// multi-byte character.
    pub fn flush(&mut self) -> Option<String> {
        let mut keep = token_prefix_len(&self.buf, &self.token);
        let head = &self.buf[..self.buf.len() - keep];
        if let Err(e) = std::str::from_utf8(head)
            && e.error_len().is_none()
        {
            keep += head.len() - e.valid_up_to();
        }
        let cut = self.buf.len() - keep;
        take_text(&mut self.buf, cut)
    }
}

fn take_text(buf: &mut Vec<u8>, upto: usize) -> Option<String> {
    let upto = upto.min(buf.len());
    if upto == 0 {
        return None;
    }
    let rest = buf.split_off(upto);
    let text = String::from_utf8_lossy(buf).into_owned();
    *buf = rest;
    Some(text)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Length of the longest end of `buf` that is a proper start of `token`.
fn token_prefix_len(buf: &[u8], token: &[u8]) -> usize {
    let max = buf.len().min(token.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|k| buf.ends_with(&token[..*k]))
        .unwrap_or(0)
}

/// Unix time in nanoseconds, as the SDK's `OutputMessage.timestamp`.
pub fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Fields of a `result` line the SDK's `Result` knows.
const RESULT_FIELDS: [&str; 14] = [
    "text",
    "html",
    "markdown",
    "svg",
    "png",
    "jpeg",
    "pdf",
    "latex",
    "json",
    "javascript",
    "data",
    "chart",
    "is_main_result",
    "extra",
];

/// One NDJSON line of an `execute` response.
pub enum OutLine {
    Stdout(String),
    Stderr(String),
    Result(Map<String, Value>),
    Error {
        name: String,
        value: String,
        traceback: String,
    },
    ExecutionCount(u64),
    End,
}

impl OutLine {
    /// The line, with its newline.
    pub fn encode(&self) -> Vec<u8> {
        let v = match self {
            OutLine::Stdout(text) => json!({"type": "stdout", "text": text, "timestamp": now_ns()}),
            OutLine::Stderr(text) => json!({"type": "stderr", "text": text, "timestamp": now_ns()}),
            OutLine::Result(data) => {
                let mut m: Map<String, Value> = data
                    .iter()
                    .filter(|(k, v)| RESULT_FIELDS.contains(&k.as_str()) && !v.is_null())
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                let main = m.get("is_main_result").and_then(Value::as_bool) == Some(true);
                m.insert("is_main_result".into(), Value::Bool(main));
                m.insert("type".into(), Value::String("result".into()));
                Value::Object(m)
            }
            OutLine::Error {
                name,
                value,
                traceback,
            } => json!({"type": "error", "name": name, "value": value, "traceback": traceback}),
            OutLine::ExecutionCount(n) => {
                json!({"type": "number_of_executions", "execution_count": n})
            }
            OutLine::End => json!({"type": "end_of_execution"}),
        };
        let mut line = serde_json::to_vec(&v).unwrap_or_default();
        line.push(b'\n');
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn languages_parse_with_python_as_default() {
        assert_eq!(Language::parse(None), Ok(Language::Python));
        assert_eq!(Language::parse(Some("")), Ok(Language::Python));
        assert_eq!(Language::parse(Some("Python")), Ok(Language::Python));
        assert_eq!(Language::parse(Some("js")), Ok(Language::JavaScript));
        assert_eq!(Language::parse(Some("bash")), Ok(Language::Bash));
        let err = Language::parse(Some(" R ")).unwrap_err();
        assert_eq!(err, UnsupportedLanguage { name: "r".into() });
        assert_eq!(
            err.to_string(),
            "language \"r\" is not supported here (supported: python, javascript, bash)"
        );
        assert!(Language::parse(Some("java")).is_err());
    }

    #[test]
    fn exec_commands_are_one_json_line() {
        let env = BTreeMap::from([("K".to_string(), "v\nw".to_string())]);
        let line = Command::Exec {
            code: "print('a')\nx = 1",
            env: &env,
            token: "T",
        }
        .to_line();
        assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1);
        assert_eq!(line.last(), Some(&b'\n'));
        let v: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(v["op"], "exec");
        assert_eq!(v["code"], "print('a')\nx = 1");
        assert_eq!(v["env"]["K"], "v\nw");
        assert_eq!(v["token"], "T");
        let prog = program_line("a\nb \"q\"");
        assert_eq!(prog.iter().filter(|b| **b == b'\n').count(), 1);
        let back: String = serde_json::from_slice(&prog).unwrap();
        assert_eq!(back, "a\nb \"q\"");
    }

    #[test]
    fn worker_events_parse_and_garbage_does_not() {
        assert_eq!(parse_event(br#"{"ev":"ready"}"#), Some(Event::Ready));
        assert_eq!(parse_event(br#"{"ev":"start"}"#), Some(Event::Start));
        assert_eq!(
            parse_event(br#"{"ev":"done","token":"T","status":130}"#),
            Some(Event::Done {
                token: "T".into(),
                status: 130
            })
        );
        assert_eq!(
            parse_event(br#"{"ev":"done","token":"T"}"#),
            Some(Event::Done {
                token: "T".into(),
                status: 0
            })
        );
        let Some(Event::Error {
            name,
            value,
            traceback,
        }) = parse_event(
            br#"{"ev":"error","name":"ValueError","value":"boom","traceback":"Traceback..."}"#,
        )
        else {
            panic!("error event")
        };
        assert_eq!((name.as_str(), value.as_str()), ("ValueError", "boom"));
        assert_eq!(traceback, "Traceback...");
        let Some(Event::Result { data }) =
            parse_event(br#"{"ev":"result","data":{"text":"42","is_main_result":true}}"#)
        else {
            panic!("result event")
        };
        assert_eq!(data["text"], "42");
        for bad in [
            &b"not json"[..],
            br#"{"ev":"nope"}"#,
            br#"{"ev":"error","name":1}"#,
            br#"[1,2]"#,
            b"",
        ] {
            assert_eq!(parse_event(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn bash_frames_carry_four_fields_and_quote_env() {
        let env = BTreeMap::from([("A_1".to_string(), "it's $HOME".to_string())]);
        let frame = bash_frame("TOK", &env, "echo hi").unwrap();
        let fields: Vec<&[u8]> = frame.split(|b| *b == 0).collect();
        // Four NUL-terminated fields leave an empty tail after the last NUL.
        assert_eq!(fields.len(), 5);
        assert_eq!(fields[0], b"TOK");
        let pre = String::from_utf8_lossy(fields[1]);
        assert!(pre.contains(r"export A_1='it'\''s $HOME'"), "{pre}");
        assert_eq!(fields[2], b"echo hi");
        let post = String::from_utf8_lossy(fields[3]);
        assert!(post.contains("unset A_1"), "{post}");
        assert!(bash_frame("T", &BTreeMap::new(), "a\0b").is_err());
        for bad in ["1A", "A-B", "", "A B", "A=B"] {
            let env = BTreeMap::from([(bad.to_string(), "v".to_string())]);
            assert!(bash_frame("T", &env, "true").is_err(), "{bad:?}");
        }
    }

    #[test]
    fn bash_prelude_and_postlude_restore_the_environment() {
        let env = BTreeMap::from([
            ("SP_SET".to_string(), "new 'v'".to_string()),
            ("SP_UNSET".to_string(), "x".to_string()),
        ]);
        let frame = bash_frame("T", &env, "").unwrap();
        let fields: Vec<String> = frame
            .split(|b| *b == 0)
            .map(|f| String::from_utf8_lossy(f).into_owned())
            .collect();
        let script = format!(
            "export SP_SET=old\n{}\necho \"in:$SP_SET:$SP_UNSET\"\n{}\necho \"out:$SP_SET:${{SP_UNSET-none}}\"",
            fields[1], fields[3]
        );
        let out = std::process::Command::new("bash")
            .args(["--noprofile", "--norc", "-c", &script])
            .env_remove("SP_UNSET")
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "in:new 'v':x\nout:old:none\n"
        );
    }

    #[test]
    fn env_names_must_be_identifiers() {
        assert!(valid_env_name("PATH"));
        assert!(valid_env_name("_a1"));
        assert!(!valid_env_name("1a"));
        assert!(!valid_env_name(""));
        assert!(!valid_env_name("a.b"));
        assert!(!valid_env_name(&"A".repeat(300)));
    }

    #[test]
    fn splitter_sends_whole_lines_and_stops_at_the_token() {
        let mut s = OutputSplitter::new("<END>");
        assert_eq!(s.push(b"hel"), None);
        assert!(s.pending());
        assert_eq!(s.push(b"lo\nwor").as_deref(), Some("hello\n"));
        assert_eq!(s.push(b"ld\nagain\n").as_deref(), Some("world\nagain\n"));
        assert_eq!(s.push(b"tail<EN").as_deref(), None);
        assert!(!s.done());
        assert_eq!(s.push(b"D>after").as_deref(), Some("tail"));
        assert!(s.done());
        assert_eq!(s.push(b"more\n"), None);
        assert!(!s.pending());
    }

    #[test]
    fn splitter_flush_holds_back_token_starts_and_split_characters() {
        let mut s = OutputSplitter::new("<END>");
        s.push(b"progress 50%<E");
        assert_eq!(s.flush().as_deref(), Some("progress 50%"));
        assert_eq!(s.push(b"ND>").as_deref(), None);
        assert!(s.done());

        let mut s = OutputSplitter::new("<END>");
        // "é" is 0xC3 0xA9: a flush between the two bytes must not break it.
        s.push(b"caf\xC3");
        assert_eq!(s.flush().as_deref(), Some("caf"));
        s.push(b"\xA9!");
        assert_eq!(s.flush().as_deref(), Some("é!"));
        assert_eq!(s.flush(), None);

        // Invalid bytes are replaced, not held forever.
        let mut s = OutputSplitter::new("<END>");
        s.push(b"\xFF\xFEx");
        assert_eq!(s.flush().as_deref(), Some("\u{FFFD}\u{FFFD}x"));
    }

    #[test]
    fn splitter_sends_long_lines_without_a_newline() {
        let mut s = OutputSplitter::new("<END>");
        let big = vec![b'a'; MAX_PENDING + 10];
        let out = s.push(&big).unwrap();
        assert_eq!(out.len(), MAX_PENDING + 10);
        assert!(!s.pending());
    }

    #[test]
    fn splitter_end_sends_what_is_left() {
        let mut s = OutputSplitter::new("<END>");
        s.push(b"no newline<E");
        assert_eq!(s.end().as_deref(), Some("no newline<E"));
        assert!(s.done());
    }

    #[test]
    fn tokens_are_unique_and_json_safe() {
        let (a, b) = (new_token(), new_token());
        assert_ne!(a, b);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    }

    #[test]
    fn output_lines_have_the_sdk_shape() {
        let v: Value = serde_json::from_slice(&OutLine::Stdout("hi\n".into()).encode()).unwrap();
        assert_eq!(v["type"], "stdout");
        assert_eq!(v["text"], "hi\n");
        assert!(v["timestamp"].as_i64().unwrap() > 1_600_000_000_000_000_000);
        let v: Value = serde_json::from_slice(&OutLine::Stderr("e".into()).encode()).unwrap();
        assert_eq!(v["type"], "stderr");

        let mut data = Map::new();
        data.insert("text".into(), "42".into());
        data.insert("png".into(), Value::Null);
        data.insert("type".into(), "forged".into());
        data.insert("bogus".into(), 1.into());
        data.insert("is_main_result".into(), true.into());
        let line = OutLine::Result(data).encode();
        let v: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(v["type"], "result");
        assert_eq!(v["text"], "42");
        assert_eq!(v["is_main_result"], true);
        assert!(v.get("png").is_none() && v.get("bogus").is_none());

        let v: Value = serde_json::from_slice(
            &OutLine::Error {
                name: "E".into(),
                value: "v".into(),
                traceback: "t".into(),
            }
            .encode(),
        )
        .unwrap();
        assert_eq!(
            (&v["type"], &v["name"], &v["value"], &v["traceback"]),
            (
                &Value::from("error"),
                &Value::from("E"),
                &Value::from("v"),
                &Value::from("t")
            )
        );
        let v: Value = serde_json::from_slice(&OutLine::ExecutionCount(3).encode()).unwrap();
        assert_eq!(v["type"], "number_of_executions");
        assert_eq!(v["execution_count"], 3);
        let line = OutLine::End.encode();
        assert_eq!(line.last(), Some(&b'\n'));
        let v: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(v["type"], "end_of_execution");
    }
}
