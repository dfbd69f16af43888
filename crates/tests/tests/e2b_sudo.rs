//! `sudo` and `python` in E2B-created sandboxes, as E2B's base image has them: `sudo`
//! runs a command as the sandbox's root through the agent (no setuid, no_new_privs
//! kept), `python` is `python3`; both go with the daemon's `[e2b] sudo` switch, and a
//! sandbox user can neither replace the agent's socket nor upset the agent through it.

use reqwest::StatusCode;
use sandpit_api::CreateSandboxRequest;
use sandpit_tests::{Daemon, sh, sh_root};
use serde_json::{Value, json};

/// Creates a sandbox through E2B's `POST /v2/sandboxes` and returns its id.
async fn e2b_create(d: &Daemon) -> String {
    let resp = sandpit_tests::http()
        .post(format!("{}/v2/sandboxes", d.url))
        .header("X-API-Key", &d.key)
        .json(&json!({"templateID": "base"}))
        .send()
        .await
        .expect("create");
    let status = resp.status();
    let v: Value = resp.json().await.expect("body");
    assert_eq!(status, StatusCode::CREATED, "{v}");
    v["sandboxID"].as_str().expect("sandboxID").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sudo_and_python_work_in_an_e2b_sandbox() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = e2b_create(&d).await;

    let out = sh(
        &c,
        &id,
        "id -u; sudo id -u; sudo -u user id -u; sudo -n -- id -un",
    )
    .await;
    assert_eq!(out.stdout, "1000\n0\n1000\nroot\n", "{}", out.stderr);
    assert_eq!(out.exit_code, 0);
    // E2B's SDKs run commands in a login shell, whose profile resets PATH.
    let out = sh(&c, &id, "exec bash -lc 'sudo id -u && command -v sudo'").await;
    assert_eq!(out.stdout, "0\n/usr/local/bin/sudo\n", "{}", out.stderr);

    // Exit codes and signals pass through.
    let out = sh(&c, &id, "sudo sh -c 'exit 7'").await;
    assert_eq!(out.exit_code, 7, "{}", out.stderr);
    let out = sh(&c, &id, "sudo sh -c 'kill -TERM $$'; echo $?").await;
    assert_eq!(out.stdout, "143\n", "{}", out.stderr);
    // Signals sent to sudo reach the command; a sudo killed outright takes it along.
    let out = sh(
        &c,
        &id,
        "sudo sh -c 'trap \"echo got-term; exit 3\" TERM; while :; do sleep 0.1; done' & p=$!; sleep 1; kill -TERM $p; wait $p; echo $?",
    )
    .await;
    assert_eq!(out.stdout, "got-term\n3\n", "{}", out.stderr);
    let out = sh(
        &c,
        &id,
        "sudo sh -c 'echo $$ > /tmp/root-pid; exec sleep 100' & p=$!; sleep 1; kill -KILL $p; sleep 1; test -d /proc/$(cat /tmp/root-pid) && echo alive || echo gone",
    )
    .await;
    assert_eq!(out.stdout, "gone\n", "{}", out.stderr);
    // stdin, stdout and stderr are the caller's own.
    let out = sh(&c, &id, "echo hi | sudo cat; sudo sh -c 'echo err >&2'").await;
    assert_eq!(out.stdout, "hi\n", "{}", out.stderr);
    assert_eq!(out.stderr, "err\n");
    // The directory is kept, the environment reset unless -E, HOME is root's.
    let out = sh(
        &c,
        &id,
        "cd /tmp && sudo pwd; export KEEP=yes; sudo sh -c 'echo ${KEEP:-no} $HOME $SUDO_USER'; sudo -E sh -c 'echo $KEEP'; sudo -i pwd",
    )
    .await;
    assert_eq!(
        out.stdout, "/tmp\nno /root user\nyes\n/root\n",
        "{}",
        out.stderr
    );
    // What it runs is root of the sandbox: it may write root's files.
    let out = sh(
        &c,
        &id,
        "sudo touch /etc/made-by-sudo && stat -c %u /etc/made-by-sudo",
    )
    .await;
    assert_eq!(out.stdout, "0\n", "{}", out.stderr);
    // Unknown options and users are refused plainly.
    let out = sh(&c, &id, "sudo -X id").await;
    assert_eq!(out.exit_code, 1);
    assert!(out.stderr.contains("unknown option"), "{}", out.stderr);
    let out = sh(&c, &id, "sudo -u postgres id").await;
    assert_eq!(out.exit_code, 1);
    assert!(out.stderr.contains("unknown user"), "{}", out.stderr);
    let out = sh(&c, &id, "sudo no-such-command").await;
    assert_eq!(out.exit_code, 1);
    assert!(out.stderr.contains("not found"), "{}", out.stderr);
    // no_new_privs is kept for what sudo runs.
    let out = sh(&c, &id, "sudo grep NoNewPrivs /proc/self/status").await;
    assert_eq!(out.stdout, "NoNewPrivs:\t1\n", "{}", out.stderr);

    let out = sh(&c, &id, "python -c 'print(1)'").await;
    assert_eq!(out.stdout, "1\n", "{}", out.stderr);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_user_cannot_replace_or_upset_the_sudo_socket() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = e2b_create(&d).await;

    let out = sh(
        &c,
        &id,
        "stat -c '%u %a %F' /run /run/sandpit /run/sandpit/sudo.sock",
    )
    .await;
    assert_eq!(
        out.stdout, "0 755 directory\n0 755 directory\n0 666 socket\n",
        "{}",
        out.stderr
    );
    for attempt in [
        "rm -f /run/sandpit/sudo.sock",
        "mv /run/sandpit /run/moved",
        "ln -sfn /tmp/fake /run/sandpit/sudo.sock",
        "rm -rf /run/sandpit",
        "mkdir /run/sandpit2",
        "chmod 777 /run/sandpit",
    ] {
        let out = sh(&c, &id, attempt).await;
        assert_ne!(out.exit_code, 0, "{attempt} succeeded");
    }

    // A silent peer holds a connection open while others are served; the agent drops
    // it after its request timeout.
    let silent = "import socket,time\ns=socket.socket(socket.AF_UNIX)\ns.connect('/run/sandpit/sudo.sock')\ns.settimeout(30)\nt=time.time()\nd=s.recv(65536)\nprint('dropped', int(time.time()-t) < 25)\n";
    let silent_run = {
        let c = d.client();
        let id = id.clone();
        tokio::spawn(async move {
            let req = sandpit_api::RunCommandRequest {
                argv: vec!["python3".into(), "-c".into(), silent.into()],
                ..Default::default()
            };
            c.run(&id, &req).await.expect("run")
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let out = sh(&c, &id, "sudo id -u").await;
    assert_eq!(
        out.stdout, "0\n",
        "served beside a silent peer: {}",
        out.stderr
    );

    // Malformed requests: each answered with an error (or closed), never a crash.
    let hostile = r#"
import array,socket,struct,json
def conn():
    s=socket.socket(socket.AF_UNIX); s.settimeout(15); s.connect('/run/sandpit/sudo.sock'); return s
def answer(s):
    d=b''
    try:
        while True:
            b=s.recv(65536)
            if not b: break
            d+=b
    except ConnectionResetError:
        # The agent hung up on bytes it did not read: what it answered first still counts.
        pass
    except Exception as e:
        return 'ERR %s'%e
    return d[4:].decode(errors='replace')
def send(s, data, n=None):
    # The agent may refuse and hang up before the rest arrives.
    try:
        if n is None: s.sendall(data)
        else: s.sendmsg([data], fds(n))
    except (BrokenPipeError, ConnectionResetError):
        pass
fds=lambda n: [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i',[0,1,2][:n] if n<=3 else [0]*n))]
res=[]
# oversized length
s=conn(); send(s, struct.pack('<I',0xffffffff), 3); res.append(answer(s))
# not JSON
b=b'\xff\x00garbage'; s=conn(); send(s, struct.pack('<I',len(b)), 3); send(s, b); res.append(answer(s))
# no descriptors
b=json.dumps({'user':'root','cwd':'/','argv':['id'],'env':[]}).encode(); s=conn(); send(s, struct.pack('<I',len(b))+b); res.append(answer(s))
# too many descriptors
s=conn(); send(s, struct.pack('<I',len(b)), 40); send(s, b); res.append(answer(s))
# a NUL in argv
b2=json.dumps({'user':'root','cwd':'/','argv':['i\u0000d'],'env':[]}).encode(); s=conn(); send(s, struct.pack('<I',len(b2)), 3); send(s, b2); res.append(answer(s))
# a length promising more than is sent, then a hang-up
s=conn(); send(s, struct.pack('<I',1000), 3); send(s, b'{"us'); s.shutdown(socket.SHUT_WR); res.append(answer(s))
for r in res: print(r)
"#;
    let req = sandpit_api::RunCommandRequest {
        argv: vec!["python3".into(), "-c".into(), hostile.into()],
        ..Default::default()
    };
    let out = c.run(&id, &req).await.expect("run");
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 6, "{}", out.stdout);
    for (i, l) in lines.iter().enumerate() {
        assert!(
            l.starts_with(r#"{"error":"#) || l.is_empty(),
            "answer {i}: {l}"
        );
        assert!(!l.contains(r#""exit""#), "answer {i} ran something: {l}");
    }
    assert!(lines[0].contains("exceeds"), "{}", lines[0]);
    assert!(lines[2].contains("descriptors"), "{}", lines[2]);
    assert!(lines[3].contains("descriptors"), "{}", lines[3]);
    assert!(lines[4].contains("NUL"), "{}", lines[4]);

    let silent_out = silent_run.await.expect("silent peer task");
    assert_eq!(
        silent_out.stdout.trim_end(),
        "dropped True",
        "{}",
        silent_out.stderr
    );
    // Still serving (the agent is PID 1: had it crashed, the sandbox would be gone).
    let out = sh(&c, &id, "sudo id -u").await;
    assert_eq!(out.stdout, "0\n", "{}", out.stderr);
    // The root's commands are unaffected as well.
    let out = sh_root(&c, &id, "id -u").await;
    assert_eq!(out.stdout, "0\n");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_switch_leaves_sudo_out_and_v1_asks_for_it() {
    let d = Daemon::builder()
        .config("[e2b]\nsudo = false\n")
        .start()
        .await;
    let c = d.client();
    let id = e2b_create(&d).await;
    let out = sh(&c, &id, "sudo id -u").await;
    assert_eq!(out.exit_code, 127, "{} {}", out.stdout, out.stderr);
    assert!(out.stderr.contains("not found"), "{}", out.stderr);
    let out = sh(&c, &id, "python -c 'print(1)'").await;
    assert_eq!(out.exit_code, 127, "{}", out.stderr);
    let out = sh(&c, &id, "test -e /run/sandpit; echo $?").await;
    assert_eq!(out.stdout, "1\n");

    // sandpit's own API: off unless the create asks.
    let plain = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .expect("create");
    let out = sh(&c, &plain.id, "sudo id -u").await;
    assert_eq!(out.exit_code, 127, "{}", out.stderr);
    let asked = c
        .create_sandbox(&CreateSandboxRequest {
            sudo: Some(true),
            ..Default::default()
        })
        .await
        .expect("create");
    let out = sh(&c, &asked.id, "sudo id -u; python -c 'print(2)'").await;
    assert_eq!(out.stdout, "0\n2\n", "{}", out.stderr);
    // Kept with the sandbox: a wake from hibernation and a fork boot with it again.
    c.hibernate(&asked.id).await.expect("hibernate");
    c.resume(&asked.id).await.expect("resume");
    let out = sh(&c, &asked.id, "sudo id -u").await;
    assert_eq!(out.stdout, "0\n", "after a wake: {}", out.stderr);
    let forks = c
        .fork(&asked.id, &sandpit_api::ForkRequest::default())
        .await
        .expect("fork");
    let out = sh(&c, &forks[0].id, "sudo id -u").await;
    assert_eq!(out.stdout, "0\n", "in a fork: {}", out.stderr);
    let out = sh(&c, &plain.id, "test -e /usr/local/bin/sudo || echo none").await;
    assert_eq!(out.stdout, "none\n");
    d.shutdown().await;
}

/// A template of its own (its `/usr` is not the host's): the shims go into its writable
/// layer's `/usr/local/bin`, `python` names its `python3`, and its own files stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_template_gets_the_shims_in_its_own_usr_local_bin() {
    let d = Daemon::start().await;
    let c = d.client();
    let src = tempfile::tempdir().expect("tempdir");
    sandpit_tests::rootfs_with_programs(
        src.path(),
        &[
            ("/bin/dash", "usr/bin/sh"),
            ("/usr/bin/id", "usr/bin/id"),
            ("/usr/bin/readlink", "usr/bin/readlink"),
            ("/bin/dash", "usr/bin/python3"),
        ],
    );
    std::fs::create_dir_all(src.path().join("usr/local/bin")).expect("usr/local/bin");
    std::fs::create_dir_all(src.path().join("etc")).expect("etc");
    sandpit_tests::build_ready(&c, &sandpit_tests::dir_build("own", src.path())).await;
    let sb = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("own".into()),
            sudo: Some(true),
            ..Default::default()
        })
        .await
        .expect("create");
    let run = |script: &str| sandpit_api::RunCommandRequest {
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        ..Default::default()
    };
    let out = c
        .run(
            &sb.id,
            &run("id -u; sudo id -u; readlink /usr/local/bin/sudo /usr/local/bin/python"),
        )
        .await
        .expect("run");
    assert_eq!(
        out.stdout, "1000\n0\n/.sandpit/agent\n/usr/bin/python3\n",
        "{}",
        out.stderr
    );
    // The user cannot take the shim's place either.
    let out = c
        .run(
            &sb.id,
            &run("rm -f /usr/local/bin/sudo 2>/dev/null; readlink /usr/local/bin/sudo"),
        )
        .await
        .expect("run");
    assert_eq!(out.stdout, "/.sandpit/agent\n", "{}", out.stderr);
    d.shutdown().await;
}
