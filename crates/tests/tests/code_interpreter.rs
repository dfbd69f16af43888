//! The code interpreter (E2B code-interpreter's port-49999 server) in the agent, driven
//! through the daemon's agent pass-through as `/code/...`: stateful python, bash and
//! javascript contexts, streamed NDJSON in the SDK's shape, figures, errors, users, env
//! vars, context lifecycle and interrupts.

use base64::Engine;
use futures::StreamExt;
use sandpit_api::LimitsSpec;
use sandpit_tests::{Daemon, sh, sh_root};
use serde_json::{Value, json};
use std::time::Duration;

/// Bounds every wait on the interpreter: a hang fails the test instead of stalling it.
const WAIT: Duration = Duration::from_secs(120);

struct Interp {
    base: String,
    key: String,
    http: reqwest::Client,
}

/// The parsed lines of one `execute` response.
#[derive(Debug)]
struct Execution {
    lines: Vec<Value>,
}

impl Execution {
    fn of_type(&self, t: &str) -> Vec<&Value> {
        self.lines.iter().filter(|l| l["type"] == t).collect()
    }
    fn stdout(&self) -> String {
        self.of_type("stdout")
            .iter()
            .map(|l| l["text"].as_str().unwrap())
            .collect()
    }
    fn stderr(&self) -> String {
        self.of_type("stderr")
            .iter()
            .map(|l| l["text"].as_str().unwrap())
            .collect()
    }
    fn main_text(&self) -> Option<String> {
        self.of_type("result")
            .iter()
            .find(|l| l["is_main_result"] == true)
            .and_then(|l| l["text"].as_str().map(str::to_string))
    }
    fn error(&self) -> Option<&Value> {
        self.of_type("error").into_iter().last()
    }
    fn count(&self) -> u64 {
        self.of_type("number_of_executions")[0]["execution_count"]
            .as_u64()
            .unwrap()
    }
}

/// Checks one line against what the SDK's parser reads.
fn check_shape(line: &Value) {
    match line["type"].as_str() {
        Some("stdout" | "stderr") => {
            assert!(line["text"].is_string(), "{line}");
            assert!(line["timestamp"].as_i64().unwrap() > 0, "{line}");
        }
        Some("result") => assert!(line["is_main_result"].is_boolean(), "{line}"),
        Some("error") => {
            for k in ["name", "value", "traceback"] {
                assert!(line[k].is_string(), "{line}");
            }
        }
        Some("number_of_executions") => assert!(line["execution_count"].is_u64(), "{line}"),
        Some("end_of_execution") => {}
        _ => panic!("unexpected line {line}"),
    }
}

impl Interp {
    fn new(d: &Daemon, id: &str) -> Self {
        Self {
            base: format!("{}/v1/sandboxes/{id}/agent/code", d.url),
            key: d.key.clone(),
            http: sandpit_tests::http(),
        }
    }

    fn req(
        &self,
        method: reqwest::Method,
        path: &str,
        user: Option<&str>,
    ) -> reqwest::RequestBuilder {
        let r = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header("x-api-key", &self.key);
        match user {
            Some(u) => r.header(
                "authorization",
                format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(format!("{u}:"))
                ),
            ),
            None => r,
        }
    }

    /// Starts an execution and returns the streaming response.
    async fn start(&self, body: Value, user: Option<&str>) -> reqwest::Response {
        tokio::time::timeout(
            WAIT,
            self.req(reqwest::Method::POST, "/execute", user)
                .json(&body)
                .send(),
        )
        .await
        .expect("execute answered")
        .unwrap()
    }

    async fn exec_as(&self, body: Value, user: Option<&str>) -> Execution {
        let r = self.start(body.clone(), user).await;
        assert_eq!(r.status(), 200, "{body}");
        let text = tokio::time::timeout(WAIT, r.text())
            .await
            .expect("execution finished")
            .unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        for l in &lines {
            check_shape(l);
        }
        assert_eq!(
            lines.last().map(|l| l["type"].clone()),
            Some(json!("end_of_execution")),
            "{text}"
        );
        Execution { lines }
    }

    async fn exec(&self, body: Value) -> Execution {
        self.exec_as(body, None).await
    }

    async fn py(&self, code: &str) -> Execution {
        self.exec(json!({ "code": code })).await
    }

    /// A request that must fail: returns its status and JSON body.
    async fn fail(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut r = self.req(method, path, None);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let r = r.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn create(&self, body: Value) -> Value {
        let r = self
            .req(reqwest::Method::POST, "/contexts", None)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    }

    async fn list(&self) -> Vec<Value> {
        let r = self
            .req(reqwest::Method::GET, "/contexts", None)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_keeps_state_streams_output_and_reports_results_errors_and_figures() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    let it = Interp::new(&d, &id);

    let r = it
        .http
        .get(format!("{}/health", it.base))
        .header("x-api-key", &d.key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // State across cells, and a trailing expression as the main result.
    let e = it.py("x = 41").await;
    assert_eq!(e.main_text(), None);
    assert!(e.error().is_none(), "{:?}", e.lines);
    let first_count = e.count();
    let e = it.py("x + 1").await;
    assert_eq!(e.main_text().as_deref(), Some("42"));
    assert_eq!(e.count(), first_count + 1);
    let e = it
        .py("def double(v):\n    return v * 2\nimport math\n'abc'")
        .await;
    assert_eq!(e.main_text().as_deref(), Some("'abc'"));
    let e = it.py("double(math.floor(x / 2))").await;
    assert_eq!(e.main_text().as_deref(), Some("40"));

    // stdout and stderr, in order; display() gives extra results.
    let e = it
        .py("import sys\nfor i in range(5):\n    print('line', i)\nprint('oops', file=sys.stderr)\ndisplay([1, 2])\nNone")
        .await;
    assert_eq!(e.stdout(), "line 0\nline 1\nline 2\nline 3\nline 4\n");
    assert_eq!(e.stderr(), "oops\n");
    let extra: Vec<_> = e
        .of_type("result")
        .into_iter()
        .filter(|r| r["is_main_result"] == false)
        .collect();
    assert_eq!(extra.len(), 1);
    assert_eq!(extra[0]["text"], "[1, 2]");
    assert_eq!(e.main_text(), None);

    // Output streams while the cell runs: the cell waits for a file that the test
    // creates only after it has read the first line.
    let r = it
        .start(
            json!({"code": "import os, time\nprint('first', flush=True)\nwhile not os.path.exists('/tmp/go'):\n    time.sleep(0.02)\nprint('second')"}),
            None,
        )
        .await;
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let mut buf = Vec::new();
    let mut seen: Vec<Value> = Vec::new();
    while !seen.iter().any(|l| l["type"] == "stdout") {
        let chunk = tokio::time::timeout(WAIT, body.next())
            .await
            .expect("first output streamed before the cell ends")
            .expect("stream open")
            .unwrap();
        buf.extend_from_slice(&chunk);
        while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            seen.push(serde_json::from_slice(&line).unwrap());
        }
    }
    let out: Vec<&Value> = seen.iter().filter(|l| l["type"] == "stdout").collect();
    assert_eq!(out[0]["text"], "first\n");
    assert!(!seen.iter().any(|l| l["type"] == "end_of_execution"));
    let touch = sh(&c, &id, "touch /tmp/go").await;
    assert_eq!(touch.exit_code, 0);
    let mut rest = String::from_utf8(buf).unwrap();
    while let Some(chunk) = tokio::time::timeout(WAIT, body.next()).await.expect("rest") {
        rest.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    let rest: Vec<Value> = rest
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let texts: Vec<&str> = rest
        .iter()
        .filter(|l| l["type"] == "stdout")
        .map(|l| l["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, ["second\n"]);
    assert_eq!(rest.last().unwrap()["type"], "end_of_execution");

    // An exception: output printed before it still arrives; name, value, traceback.
    let e = it
        .py("print('before')\ndef boom():\n    raise ValueError('boom happened')\nboom()")
        .await;
    assert_eq!(e.stdout(), "before\n");
    let err = e.error().expect("error line");
    assert_eq!(err["name"], "ValueError");
    assert_eq!(err["value"], "boom happened");
    let tb = err["traceback"].as_str().unwrap();
    assert!(tb.starts_with("Traceback (most recent call last):"), "{tb}");
    assert!(tb.contains("in boom"), "{tb}");
    assert!(tb.trim_end().ends_with("ValueError: boom happened"), "{tb}");
    assert!(!tb.contains("sandpit"), "worker frames leak: {tb}");
    assert_eq!(e.main_text(), None);
    let e = it.py("x = = 1").await;
    assert_eq!(e.error().unwrap()["name"], "SyntaxError");
    // The context survived both.
    assert_eq!(it.py("x").await.main_text().as_deref(), Some("41"));

    // env_vars apply to one cell only.
    let e = it
        .exec(json!({"code": "import os\nos.environ['SP_CELL_VAR']", "env_vars": {"SP_CELL_VAR": "hello 'there'"}}))
        .await;
    assert_eq!(e.main_text().as_deref(), Some("\"hello 'there'\""));
    let e = it.py("os.environ.get('SP_CELL_VAR', 'unset')").await;
    assert_eq!(e.main_text().as_deref(), Some("'unset'"));

    // A matplotlib figure becomes a PNG result (setup.sh installs matplotlib).
    // Skipped only when the host (whose /usr the sandbox sees) lacks it; installed but
    // unusable in the sandbox fails below.
    let has_mpl = std::process::Command::new("/usr/bin/python3")
        .args(["-c", "import matplotlib"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if has_mpl {
        let e = it
            .py("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nplt.show()")
            .await;
        assert!(e.error().is_none(), "{:?}", e.error());
        let figs: Vec<&Value> = e
            .of_type("result")
            .into_iter()
            .filter(|r| r["png"].is_string())
            .collect();
        assert_eq!(figs.len(), 1, "{:?}", e.lines);
        let png = base64::engine::general_purpose::STANDARD
            .decode(figs[0]["png"].as_str().unwrap())
            .unwrap();
        assert!(png.len() > 1000, "png of {} bytes", png.len());
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert!(
            figs[0]["text"]
                .as_str()
                .unwrap()
                .starts_with("<Figure size")
        );
        // Shown figures are closed: the next cell has none.
        let e = it.py("len(plt.get_fignums())").await;
        assert_eq!(e.main_text().as_deref(), Some("0"));
    } else {
        eprintln!(
            "matplotlib is not installed in the sandbox: PNG check skipped (run scripts/setup.sh)"
        );
    }

    // Users: the sandbox's default user, or the one a Basic header names (each gets its
    // own default context).
    let e = it
        .py("import os\n(os.getuid(), os.environ['USER'], os.getcwd())")
        .await;
    assert_eq!(
        e.main_text().as_deref(),
        Some("(1000, 'user', '/home/user')")
    );
    let e = it
        .exec_as(
            json!({"code": "import os\n(os.getuid(), os.environ['USER'])"}),
            Some("root"),
        )
        .await;
    assert_eq!(e.main_text().as_deref(), Some("(0, 'root')"));
    let e = it.exec_as(json!({"code": "x"}), Some("root")).await;
    assert_eq!(e.error().unwrap()["name"], "NameError");
    let e = it
        .exec_as(
            json!({"code": "id -u; echo $USER", "language": "bash"}),
            Some("user"),
        )
        .await;
    assert_eq!(e.stdout(), "1000\nuser\n");
    let (status, v) = it
        .fail(
            reqwest::Method::POST,
            "/execute",
            Some(json!({"code": "1", "language": "r"})),
        )
        .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["code"], "invalid_argument");
    assert!(v["message"].as_str().unwrap().contains("\"r\""), "{v}");
    let r = it
        .req(reqwest::Method::POST, "/execute", Some("mallory"))
        .json(&json!({"code": "1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bash_and_javascript_contexts_and_the_context_lifecycle() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    let it = Interp::new(&d, &id);

    // bash keeps its cwd and variables; a failing command is an error.
    let e = it
        .exec(json!({"language": "bash", "code": "cd /tmp && MYVAR=kept && echo in $PWD"}))
        .await;
    assert_eq!(e.stdout(), "in /tmp\n");
    let e = it
        .exec(json!({"language": "bash", "code": "echo \"$MYVAR $(pwd) $SP_B\"", "env_vars": {"SP_B": "b'v"}}))
        .await;
    assert_eq!(e.stdout(), "kept /tmp b'v\n");
    let e = it
        .exec(json!({"language": "bash", "code": "echo \"[${SP_B-unset}]\"; echo warn >&2; false"}))
        .await;
    assert_eq!(e.stdout(), "[unset]\n");
    assert_eq!(e.stderr(), "warn\n");
    assert_eq!(e.error().unwrap()["value"], "exit status 1");

    // javascript (node) keeps its globals.
    let has_node = sh(&c, &id, "command -v node").await.exit_code == 0;
    if has_node {
        let e = it
            .exec(json!({"language": "javascript", "code": "let counter = 40; function inc() { return ++counter; }\nconsole.log('hi from node')"}))
            .await;
        assert_eq!(e.stdout(), "hi from node\n");
        assert!(e.error().is_none(), "{:?}", e.lines);
        let e = it
            .exec(json!({"language": "javascript", "code": "inc(); inc()"}))
            .await;
        assert_eq!(e.main_text().as_deref(), Some("42"));
        let e = it
            .exec(json!({"language": "javascript", "code": "await new Promise(r => setTimeout(() => r(counter * 2), 10))"}))
            .await;
        assert_eq!(e.main_text().as_deref(), Some("84"));
        let e = it
            .exec(json!({"language": "javascript", "code": "throw new TypeError('bad type')"}))
            .await;
        let err = e.error().unwrap();
        assert_eq!(
            (err["name"].as_str(), err["value"].as_str()),
            (Some("TypeError"), Some("bad type"))
        );
        assert!(
            err["traceback"]
                .as_str()
                .unwrap()
                .contains("TypeError: bad type")
        );
    } else {
        eprintln!("node is not installed in the sandbox: javascript checks skipped");
    }

    // Explicit contexts: create, use, list, restart (state is gone), delete.
    // The default python context exists before counting.
    assert!(it.py("None").await.error().is_none());
    let before = it.list().await.len();
    let ctx = it
        .create(json!({"language": "python", "cwd": "/tmp"}))
        .await;
    assert_eq!(ctx["language"], "python");
    assert_eq!(ctx["cwd"], "/tmp");
    let ctx_id = ctx["id"].as_str().unwrap().to_string();
    let e = it
        .exec(json!({"context_id": ctx_id, "code": "import os\nsecret = 'only here'\nos.getcwd()"}))
        .await;
    assert_eq!(e.main_text().as_deref(), Some("'/tmp'"));
    // The default python context does not share its variables.
    let e = it.py("secret").await;
    assert_eq!(e.error().unwrap()["name"], "NameError");
    let list = it.list().await;
    assert_eq!(list.len(), before + 1);
    assert!(
        list.iter()
            .any(|x| x["id"] == ctx_id.as_str() && x["cwd"] == "/tmp")
    );
    let e = it
        .exec(json!({"context_id": ctx_id, "code": "secret"}))
        .await;
    assert_eq!(e.main_text().as_deref(), Some("'only here'"));

    let r = it
        .req(
            reqwest::Method::POST,
            &format!("/contexts/{ctx_id}/restart"),
            None,
        )
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let e = it
        .exec(json!({"context_id": ctx_id, "code": "secret"}))
        .await;
    assert_eq!(e.error().unwrap()["name"], "NameError");
    assert_eq!(e.count(), 1, "a restart starts counting again");

    let (status, v) = it
        .fail(
            reqwest::Method::POST,
            "/execute",
            Some(json!({"context_id": ctx_id, "language": "bash", "code": "true"})),
        )
        .await;
    assert_eq!(status, 400, "{v}");

    let r = it
        .req(
            reqwest::Method::DELETE,
            &format!("/contexts/{ctx_id}"),
            None,
        )
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    assert_eq!(it.list().await.len(), before);
    // Its worker is gone from the sandbox.
    let ps = sh_root(
        &c,
        &id,
        "ps -eo args | grep -c '[s]andpit-python-worker' || true",
    )
    .await;
    let workers: usize = ps.stdout.trim().parse().unwrap();
    // Only the default python context's worker is left.
    assert_eq!(workers, 1, "{}", ps.stdout);

    for (method, path, body) in [
        (
            reqwest::Method::POST,
            "/execute".to_string(),
            Some(json!({"context_id": ctx_id, "code": "1"})),
        ),
        (reqwest::Method::DELETE, format!("/contexts/{ctx_id}"), None),
        (
            reqwest::Method::POST,
            format!("/contexts/{ctx_id}/restart"),
            None,
        ),
    ] {
        let (status, v) = it.fail(method, &path, body).await;
        assert_eq!(status, 404, "{path}: {v}");
        assert_eq!(v["code"], "not_found");
    }
    for bad in [
        json!({"language": "java"}),
        json!({"language": "python", "cwd": "relative/dir"}),
        json!({"language": "python", "cwd": "/no/such/dir"}),
        json!({"language": 5}),
    ] {
        let (status, v) = it
            .fail(reqwest::Method::POST, "/contexts", Some(bad.clone()))
            .await;
        assert_eq!(status, 400, "{bad}: {v}");
        assert!(v["message"].is_string(), "{v}");
    }
    for bad in [
        json!({"code": "1", "env_vars": {"BAD NAME": "x"}}),
        json!({"code": "1", "timeout": -3}),
        json!({"code": "a\u{0}b"}),
        json!({"nothing": true}),
    ] {
        let (status, v) = it
            .fail(reqwest::Method::POST, "/execute", Some(bad.clone()))
            .await;
        assert_eq!(status, 400, "{bad}: {v}");
    }
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_disconnects_interrupt_the_cell_and_keep_the_context() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    let it = Interp::new(&d, &id);

    // A timeout interrupts `while True: pass`; variables survive.
    it.py("kept = 'still here'").await;
    let e = it
        .exec(json!({"code": "print('spinning', flush=True)\nwhile True:\n    pass", "timeout": 1}))
        .await;
    assert_eq!(e.stdout(), "spinning\n");
    let err = e.error().expect("timeout error");
    assert_eq!(err["name"], "TimeoutError");
    assert!(
        err["traceback"]
            .as_str()
            .unwrap()
            .contains("KeyboardInterrupt"),
        "{err}"
    );
    let e = it.py("kept").await;
    assert_eq!(e.main_text().as_deref(), Some("'still here'"));

    // A client that goes away interrupts its cell too (the SDK's timeout closes the
    // request). The next cell queues behind it and answers only once it stopped.
    let count_before = it.py("1").await.count();
    let r = it
        .start(
            json!({"code": "import time\nstarted = True\nwhile True:\n    time.sleep(0.01)"}),
            None,
        )
        .await;
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let first = tokio::time::timeout(WAIT, body.next())
        .await
        .expect("first line")
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&first).contains("number_of_executions"));
    drop(body);
    let e = it.py("(started, kept)").await;
    assert_eq!(e.main_text().as_deref(), Some("(True, 'still here')"));
    // The same worker: its count went on (a restarted one would begin again at 1).
    assert_eq!(e.count(), count_before + 2);

    // bash: a timeout stops a foreground command; the shell keeps its variables.
    it.exec(json!({"language": "bash", "code": "KEEP=yes"}))
        .await;
    let e = it
        .exec(
            json!({"language": "bash", "code": "echo going; sleep 1000; echo never", "timeout": 1}),
        )
        .await;
    assert_eq!(e.stdout(), "going\n");
    assert_eq!(e.error().unwrap()["name"], "TimeoutError");
    let e = it
        .exec(json!({"language": "bash", "code": "echo $KEEP"}))
        .await;
    assert_eq!(e.stdout(), "yes\n");
    let ps = sh_root(&c, &id, "ps -eo args | grep -c '^sleep 1000' || true").await;
    assert_eq!(ps.stdout.trim(), "0");

    // javascript: a busy loop is interrupted too.
    if sh(&c, &id, "command -v node").await.exit_code == 0 {
        it.exec(json!({"language": "javascript", "code": "var survivor = 7"}))
            .await;
        let e = it
            .exec(json!({"language": "javascript", "code": "while (true) {}", "timeout": 1}))
            .await;
        assert_eq!(e.error().unwrap()["name"], "TimeoutError");
        let e = it
            .exec(json!({"language": "javascript", "code": "survivor * 6"}))
            .await;
        assert_eq!(e.main_text().as_deref(), Some("42"));
    }

    // A cell that ignores interrupts has its worker killed; the context starts afresh.
    it.py("doomed = 1").await;
    let e = it
        .exec(json!({"code": "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass", "timeout": 1}))
        .await;
    let err = e.error().unwrap();
    assert_eq!(err["name"], "TimeoutError", "{err}");
    assert!(
        err["value"].as_str().unwrap().contains("fresh state"),
        "{err}"
    );
    let e = it.py("doomed").await;
    assert_eq!(e.error().unwrap()["name"], "NameError");
    it.py("kept = 'again'").await;

    // A worker that dies mid-cell is reported, and the context starts afresh.
    let e = it.py("import os\nos._exit(3)").await;
    assert_eq!(e.error().unwrap()["name"], "WorkerExited");
    let e = it.py("kept").await;
    assert_eq!(e.error().unwrap()["name"], "NameError");
    assert_eq!(it.py("6 * 7").await.main_text().as_deref(), Some("42"));
    d.shutdown().await;
}
