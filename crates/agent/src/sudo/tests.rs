use super::*;

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|a| a.to_string()).collect()
}

fn run(user: &str, preserve_env: bool, login: bool, shell: bool, argv: &[&str]) -> Invocation {
    Invocation::Run {
        user: user.into(),
        preserve_env,
        login,
        shell,
        argv: s(argv),
    }
}

#[test]
fn common_command_lines_parse() {
    assert_eq!(
        parse_args(&s(&["id", "-u"])).unwrap(),
        run("root", false, false, false, &["id", "-u"])
    );
    assert_eq!(
        parse_args(&s(&["-E", "-n", "--", "-weird", "x"])).unwrap(),
        run("root", true, false, false, &["-weird", "x"])
    );
    assert_eq!(
        parse_args(&s(&["-u", "user", "id"])).unwrap(),
        run("user", false, false, false, &["id"])
    );
    assert_eq!(
        parse_args(&s(&["-uuser", "id"])).unwrap(),
        run("user", false, false, false, &["id"])
    );
    assert_eq!(
        parse_args(&s(&["--user=#0", "-nE", "id"])).unwrap(),
        run("root", true, false, false, &["id"])
    );
    assert_eq!(
        parse_args(&s(&["-i"])).unwrap(),
        run("root", false, true, false, &[])
    );
    assert_eq!(
        parse_args(&s(&["-s", "echo", "a b"])).unwrap(),
        run("root", false, false, true, &["echo", "a b"])
    );
    // Options stop at the command: its own options are its own.
    assert_eq!(
        parse_args(&s(&["ls", "-u"])).unwrap(),
        run("root", false, false, false, &["ls", "-u"])
    );
    assert_eq!(parse_args(&s(&["-V"])).unwrap(), Invocation::Version);
    assert_eq!(parse_args(&s(&["-v"])).unwrap(), Invocation::Nothing);
}

#[test]
fn bad_command_lines_are_refused() {
    assert_eq!(
        parse_args(&s(&["-X", "id"])),
        Err(ArgError::UnknownOption("-X".into()))
    );
    assert_eq!(
        parse_args(&s(&["--frobnicate", "id"])),
        Err(ArgError::UnknownOption("--frobnicate".into()))
    );
    assert_eq!(parse_args(&s(&["-u"])), Err(ArgError::MissingValue('u')));
    assert_eq!(
        parse_args(&s(&["-u", "postgres", "id"])),
        Err(ArgError::UnknownUser("postgres".into()))
    );
    assert_eq!(parse_args(&s(&[])), Err(ArgError::NoCommand));
    assert_eq!(parse_args(&s(&["-E"])), Err(ArgError::NoCommand));
}

#[test]
fn the_environment_is_reset_unless_preserved() {
    let env = || {
        [
            ("TERM", "xterm"),
            ("LC_ALL", "C"),
            ("LD_PRELOAD", "/tmp/x.so"),
            ("PATH", "/home/user/bin"),
            ("SECRET", "1"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
    };
    let r = request_for("root", false, false, false, &s(&["id"]), env(), "/w".into());
    let names: Vec<&str> = r.env.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["TERM", "LC_ALL"]);
    assert_eq!(r.cwd, "/w");
    assert_eq!(r.argv, s(&["id"]));
    let r = request_for("root", true, false, false, &s(&["id"]), env(), "/w".into());
    assert_eq!(r.env.len(), 5);
    // -i: the target's login shell in its home, the command quoted for it.
    let r = request_for(
        "user",
        false,
        true,
        false,
        &s(&["echo", "a b;c"]),
        env(),
        "/w".into(),
    );
    assert_eq!(r.cwd, "/home/user");
    assert_eq!(r.argv, s(&["/bin/bash", "-l", "-c", "echo a\\ b\\;c"]));
    let r = request_for("root", false, false, true, &[], env(), "/w".into());
    assert_eq!(r.argv, s(&["/bin/bash"]));
}

fn body(v: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&v).unwrap()
}

#[test]
fn requests_are_checked() {
    let ok = body(serde_json::json!({
        "user": "root", "cwd": "/tmp", "argv": ["id", "-u"], "env": [["TERM", "xterm"]]
    }));
    let r = parse_request(&ok).unwrap();
    assert_eq!(r.argv, s(&["id", "-u"]));
    let bad = [
        serde_json::json!({"user": "nobody", "cwd": "/", "argv": ["id"], "env": []}),
        serde_json::json!({"user": "root", "cwd": "tmp", "argv": ["id"], "env": []}),
        serde_json::json!({"user": "root", "cwd": "/", "argv": [], "env": []}),
        serde_json::json!({"user": "root", "cwd": "/", "argv": [""], "env": []}),
        serde_json::json!({"user": "root", "cwd": "/", "argv": ["a\u{0}b"], "env": []}),
        serde_json::json!({"user": "root", "cwd": "/\u{0}", "argv": ["id"], "env": []}),
        serde_json::json!({"user": "root", "cwd": "/", "argv": ["id"], "env": [["A=B", "1"]]}),
        serde_json::json!({"user": "root", "cwd": "/", "argv": ["id"], "env": [["", "1"]]}),
        serde_json::json!({"user": "root", "cwd": "/", "argv": ["id"], "env": [["A", "\u{0}"]]}),
        serde_json::json!({"user": "root", "cwd": "/", "argv": ["id"], "env": [], "extra": 1}),
        serde_json::json!({"user": "root", "cwd": "/", "argv": ["id"]}),
    ];
    for b in bad {
        assert!(parse_request(&body(b.clone())).is_err(), "accepted {b}");
    }
    let many = vec!["x"; MAX_ITEMS + 1];
    let b = serde_json::json!({"user": "root", "cwd": "/", "argv": many, "env": []});
    assert!(matches!(
        parse_request(&body(b)),
        Err(SudoError::Invalid(_))
    ));
    assert!(matches!(
        parse_request(b"\xff\xfe not json"),
        Err(SudoError::Json(_))
    ));
}

#[test]
fn frames_are_bounded() {
    let f = frame(b"abc");
    assert_eq!(&f[..4], &3u32.to_le_bytes());
    assert_eq!(&f[4..], b"abc");
    assert_eq!(frame_len([3, 0, 0, 0], 3).unwrap(), 3);
    assert!(matches!(
        frame_len(u32::MAX.to_le_bytes(), MAX_REQUEST),
        Err(SudoError::TooLarge { .. })
    ));
}

#[test]
fn control_and_reply_have_a_fixed_shape() {
    assert_eq!(
        parse_control(br#"{"signal":2}"#).unwrap(),
        Control::Signal(2)
    );
    assert!(parse_control(br#"{"signal":"2"}"#).is_err());
    assert!(parse_control(br#"{"exec":"sh"}"#).is_err());
    assert_eq!(
        serde_json::to_value(Reply::Exit(7)).unwrap(),
        serde_json::json!({"exit": 7})
    );
    assert_eq!(
        serde_json::to_value(Reply::Error("no".into())).unwrap(),
        serde_json::json!({"error": "no"})
    );
}

#[test]
fn sudo_command_is_bounded_on_a_char_boundary() {
    let long = vec!["é".repeat(3000)];
    let c = sudo_command(&long);
    assert!(c.len() <= 4096);
    assert!(c.chars().all(|ch| ch == 'é'));
}

/// The process runtime's root is the daemon's own account on the host: an agent there
/// never listens for sudo, even when its config asks.
#[tokio::test]
async fn a_process_sandbox_never_serves_sudo() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Arc::new(AgentConfig {
        mode: IsolationMode::Process,
        root: dir.path().into(),
        workdir: "/".into(),
        env: Default::default(),
        listen_fd: None,
        listen_path: None,
        sudo: true,
        live: Default::default(),
    });
    let existed = std::path::Path::new(SOCKET_PATH).exists();
    let table = ProcessTable::new(cfg.clone());
    tokio::time::timeout(Duration::from_secs(5), serve(cfg, table))
        .await
        .expect("serve returns at once outside a container");
    assert_eq!(std::path::Path::new(SOCKET_PATH).exists(), existed);
}
