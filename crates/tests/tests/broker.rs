//! The credential broker against a real daemon: the secrets API (values never shown, bad
//! input refused, owners kept apart), attaching secrets to sandboxes (at create, by PUT,
//! kept across hibernation and forks), each sandbox's CA in its trust store and
//! environment, and the secret nowhere inside the sandbox.
//!
//! `full_path_through_the_egress_proxy` at the end drives sandbox curl -> egress proxy ->
//! broker -> a test HTTPS upstream in a network namespace the test makes (see `netfix`).

use sandpit_api::CreateSandboxRequest;
use sandpit_api::secrets::{CreateSecretRequest, InjectSpec};
use sandpit_client::Client;
use sandpit_tests::netfix::Upstream;
use sandpit_tests::{
    Daemon, build_ready, dir_build, http, rootfs_with_programs, sh, sh_root, small_request,
    temp_dir,
};
use std::path::Path;

const VALUE: &str = "ghp_E2eTopSecret_Value_5f3a9c";
const KEY_HEX: &str = "4f1c2a9e8b7d6c5f4e3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e";

/// Writes the broker's key `key` to a file in `dir` (mode 0600); its path.
fn write_key(dir: &Path, key: &[u8]) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("broker.key");
    std::fs::write(&path, key).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path.display().to_string()
}

/// The config of a daemon for `up` (its DNS, its test CA trusted for upstreams, `network`
/// added to the `[network]` section) whose broker's key is in the file `key`.
fn upstream_config(up: &Upstream, network: &str, key: &str) -> String {
    format!(
        "{}[broker]\nkey_file = {key:?}\nextra_ca_file = {:?}\n",
        up.config(network),
        up.ca_file().display().to_string()
    )
}

/// A daemon whose config gives the broker a key (in a file, mode 0600).
async fn daemon_with_key() -> Daemon {
    let b = Daemon::builder();
    let key = write_key(b.data_path(), format!("{KEY_HEX}\n").as_bytes());
    b.config(&format!("[broker]\nkey_file = {key:?}\n"))
        .start()
        .await
}

fn secret(name: &str) -> CreateSecretRequest {
    CreateSecretRequest {
        name: name.into(),
        value: VALUE.into(),
        hosts: vec!["api.example.com".into(), "*.githubusercontent.com".into()],
        methods: vec!["GET".into()],
        path_prefixes: vec!["/repos".into()],
        ttl_secs: Some(3600),
        inject: InjectSpec::Header {
            name: "Authorization".into(),
            format: "Bearer {value}".into(),
        },
        allow_http: false,
        expires_at_ms: None,
    }
}

/// A small sandbox with the secrets `secrets`.
fn small(secrets: &[&str]) -> CreateSandboxRequest {
    CreateSandboxRequest {
        secrets: secrets.iter().map(|s| s.to_string()).collect(),
        ..small_request()
    }
}

/// A raw request with the admin key, answering (status, body text).
async fn raw(d: &Daemon, method: reqwest::Method, path: &str, body: Option<&str>) -> (u16, String) {
    let mut rb = http()
        .request(method, format!("{}{path}", d.url))
        .bearer_auth(d.key.trim());
    if let Some(b) = body {
        rb = rb
            .header("content-type", "application/json")
            .body(b.to_string());
    }
    let resp = rb.send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_secrets_api_never_shows_a_value_and_refuses_bad_input() {
    let d = daemon_with_key().await;
    let c = d.client();
    let body = serde_json::to_string(&secret("gh")).unwrap();
    let (status, text) = raw(&d, reqwest::Method::POST, "/v1/secrets", Some(&body)).await;
    assert_eq!(status, 201, "{text}");
    assert!(!text.contains(VALUE), "{text}");
    let created: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(created["name"], "gh");
    assert_eq!(created["owner"], "admin");
    assert_eq!(created["hosts"][0], "*.githubusercontent.com");
    assert_eq!(created["methods"], serde_json::json!(["GET"]));
    assert!(created["expires_at_ms"].as_i64().unwrap() > 0);
    for path in ["/v1/secrets", "/v1/secrets/gh", "/v1/openapi.json"] {
        let (status, text) = raw(&d, reqwest::Method::GET, path, None).await;
        assert_eq!(status, 200, "{path}: {text}");
        assert!(!text.contains(VALUE), "{path}: {text}");
    }
    let mut ph = secret("ph");
    ph.inject = InjectSpec::Placeholder;
    let ph = c.create_secret(&ph, None).await.unwrap();
    assert_eq!(ph.placeholder.as_deref(), Some("SANDPIT_SECRET_ph"));

    // Bad input: 4xx with a reason, and nothing stored.
    let bad: Vec<(&str, serde_json::Value)> = vec![
        ("bad name", serde_json::json!({"name": "a b"})),
        ("no hosts", serde_json::json!({"hosts": []})),
        ("wildcard TLD", serde_json::json!({"hosts": ["*.com"]})),
        ("no methods", serde_json::json!({"methods": []})),
        ("bad method", serde_json::json!({"methods": ["GE T"]})),
        (
            "relative prefix",
            serde_json::json!({"path_prefixes": ["repos"]}),
        ),
        (
            "dot segments",
            serde_json::json!({"path_prefixes": ["/a/../b"]}),
        ),
        ("no expiry", serde_json::json!({"ttl_secs": null})),
        (
            "past expiry",
            serde_json::json!({"ttl_secs": null, "expires_at_ms": 1000}),
        ),
        (
            "header injection",
            serde_json::json!({"value": "x\r\nX-Evil: 1"}),
        ),
        ("empty value", serde_json::json!({"value": ""})),
        (
            "host header",
            serde_json::json!({"inject": {"type": "header", "name": "Host"}}),
        ),
        (
            "no {value}",
            serde_json::json!({"inject": {"type": "header", "name": "X-K", "format": "k"}}),
        ),
        ("unknown field", serde_json::json!({"colour": "red"})),
    ];
    for (what, patch) in bad {
        let mut req = serde_json::to_value(secret("bad")).unwrap();
        for (k, v) in patch.as_object().unwrap() {
            req[k] = v.clone();
        }
        let (status, text) = raw(
            &d,
            reqwest::Method::POST,
            "/v1/secrets",
            Some(&req.to_string()),
        )
        .await;
        assert_eq!(status, 400, "{what}: {text}");
        assert!(!text.contains(VALUE), "{what}: {text}");
    }
    let (status, _) = raw(&d, reqwest::Method::POST, "/v1/secrets", Some("{")).await;
    assert_eq!(status, 400);
    let dup = c.create_secret(&secret("gh"), None).await.unwrap_err();
    assert_eq!(dup.status(), Some(409));
    assert_eq!(
        c.get_secret("missing", None).await.unwrap_err().status(),
        Some(404)
    );
    assert_eq!(
        c.delete_secret("missing", None).await.unwrap_err().status(),
        Some(404)
    );
    let names: Vec<String> = c
        .list_secrets(None)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["gh", "ph"]);

    // Owners are kept apart: bob sees none of the admin's, and cannot name another owner.
    let bob = d.owner("bob").await;
    assert!(bob.list_secrets(None).await.unwrap().is_empty());
    assert_eq!(
        bob.get_secret("gh", None).await.unwrap_err().status(),
        Some(404)
    );
    assert_eq!(
        bob.delete_secret("gh", None).await.unwrap_err().status(),
        Some(404)
    );
    assert_eq!(
        bob.list_secrets(Some("admin")).await.unwrap_err().status(),
        Some(403)
    );
    assert_eq!(
        bob.create_secret(&secret("x"), Some("admin"))
            .await
            .unwrap_err()
            .status(),
        Some(403)
    );
    // The admin (operator) may keep a secret for bob; bob then sees it as his.
    c.create_secret(&secret("for-bob"), Some("bob"))
        .await
        .unwrap();
    let bobs = bob.list_secrets(None).await.unwrap();
    assert_eq!(bobs.len(), 1);
    assert_eq!(bobs[0].owner, "bob");
    // Bob cannot attach the admin's secret by name, only his own.
    let err = bob.create_sandbox(&small(&["gh"])).await.unwrap_err();
    assert_eq!(err.status(), Some(404), "{err}");
    c.delete_secret("gh", None).await.unwrap();
    assert_eq!(
        c.get_secret("gh", None).await.unwrap_err().status(),
        Some(404)
    );
    // The value is stored sealed: the database holds no copy in the clear.
    for f in std::fs::read_dir(d.data.path()).unwrap().flatten() {
        if f.file_name().to_string_lossy().starts_with("sandpit.db") {
            let bytes = std::fs::read(f.path()).unwrap();
            assert!(
                !bytes.windows(VALUE.len()).any(|w| w == VALUE.as_bytes()),
                "{} holds the value",
                f.path().display()
            );
        }
    }
    d.shutdown().await;
}

/// Lists every file under the sandbox's usual places and every process's environment and
/// arguments that hold the bytes whose hex is `hex` (given as hex, so that the scanner's
/// own arguments do not hold them). Prints how many files were read, then the hits.
const SCAN: &str = r#"
import os, sys
v = bytes.fromhex(sys.argv[1])
hits, scanned = [], 0
for pid in os.listdir('/proc'):
    if not pid.isdigit():
        continue
    for f in ('environ', 'cmdline'):
        try:
            with open(f'/proc/{pid}/{f}', 'rb') as fh:
                if v in fh.read():
                    hits.append(f'/proc/{pid}/{f}')
        except OSError:
            pass
for top in ('/etc', '/tmp', '/home', '/root', '/.sandpit', '/var', '/workspace', '/run', '/opt'):
    for d, dirs, files in os.walk(top):
        for name in files:
            p = os.path.join(d, name)
            try:
                if os.path.islink(p) or not os.path.isfile(p) or os.path.getsize(p) > (16 << 20):
                    continue
                with open(p, 'rb') as fh:
                    scanned += 1
                    if v in fh.read():
                        hits.append(p)
            except OSError:
                pass
print(scanned)
for h in hits:
    print(h)
"#;

async fn scan(c: &Client, id: &str, needle: &str) -> (usize, Vec<String>) {
    let req = sandpit_api::RunCommandRequest {
        argv: vec![
            "python3".into(),
            "-c".into(),
            SCAN.into(),
            hex::encode(needle),
        ],
        user: Some("root".into()),
        ..Default::default()
    };
    let out = c.run(id, &req).await.unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    let mut lines = out.stdout.lines();
    let scanned = lines.next().unwrap().parse().unwrap();
    (scanned, lines.map(String::from).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_trusts_its_ca_and_never_holds_its_secrets() {
    let d = daemon_with_key().await;
    let c = d.client();
    c.create_secret(&secret("gh"), None).await.unwrap();
    let sb = c.create_sandbox(&small(&["gh"])).await.unwrap();
    let id = sb.id.clone();
    assert_eq!(c.sandbox_secrets(&id).await.unwrap(), ["gh"]);

    // The CA: on its own, in a bundle with the template's roots, and named by the env.
    let env = sh(
        &c,
        &id,
        "echo $SSL_CERT_FILE $REQUESTS_CA_BUNDLE $CURL_CA_BUNDLE $NODE_EXTRA_CA_CERTS $GIT_SSL_CAINFO",
    )
    .await;
    assert_eq!(env.stdout.trim(), ["/.sandpit/ca-bundle.pem"; 5].join(" "));
    let subject = sh(
        &c,
        &id,
        "openssl x509 -in /.sandpit/ca.pem -noout -subject -ext basicConstraints",
    )
    .await;
    assert_eq!(subject.exit_code, 0, "{}", subject.stderr);
    assert!(
        subject.stdout.contains(&format!("sandpit sandbox {id} CA")),
        "{}",
        subject.stdout
    );
    assert!(subject.stdout.contains("CA:TRUE"), "{}", subject.stdout);
    let count = sh(
        &c,
        &id,
        "grep -c 'BEGIN CERTIFICATE' /.sandpit/ca-bundle.pem",
    )
    .await;
    let roots = std::fs::read_to_string("/etc/ssl/certs/ca-certificates.crt")
        .unwrap()
        .matches("BEGIN CERTIFICATE")
        .count();
    assert_eq!(count.stdout.trim(), (roots + 1).to_string());
    let tail = sh(
        &c,
        &id,
        "n=$(wc -c < /.sandpit/ca.pem); tail -c $n /.sandpit/ca-bundle.pem | cmp - /.sandpit/ca.pem && echo same",
    )
    .await;
    assert_eq!(tail.stdout.trim(), "same", "{}", tail.stderr);
    // Python's ssl module (OpenSSL's default paths honour SSL_CERT_FILE) trusts it.
    let py = sh(
        &c,
        &id,
        &format!("python3 -c \"import ssl; print(sum('sandpit sandbox {id} CA' in str(c.get('subject')) for c in ssl.create_default_context().get_ca_certs()))\""),
    )
    .await;
    assert_eq!(py.stdout.trim(), "1", "{}", py.stderr);
    // The sandbox's root cannot change what the daemon wrote.
    let tamper = sh_root(
        &c,
        &id,
        "echo x >> /.sandpit/ca-bundle.pem || echo refused; rm -f /.sandpit/ca.pem 2>/dev/null || echo kept",
    )
    .await;
    assert_eq!(tamper.stdout, "refused\nkept\n", "{}", tamper.stderr);

    // The scanner finds what is there (a marker in a file and in a process's env)...
    let marker = "sandpit-marker-81c2f";
    sh(&c, &id, &format!("echo {marker} > /tmp/marker")).await;
    let (scanned, hits) = scan(&c, &id, marker).await;
    assert!(scanned > 20, "only {scanned} files read");
    assert!(hits.contains(&"/tmp/marker".to_string()), "{hits:?}");
    // ...and finds the secret nowhere: no file, no environment, no process arguments.
    let (_, hits) = scan(&c, &id, VALUE).await;
    assert!(hits.is_empty(), "the secret is in {hits:?}");
    let ps = sh(&c, &id, "ps auxeww | wc -c").await;
    assert!(ps.stdout.trim().parse::<usize>().unwrap() > 0);
    let info = raw(
        &d,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{id}"),
        None,
    )
    .await;
    assert!(!info.1.contains(VALUE));
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attachments_are_checked_and_kept_across_hibernation_and_forks() {
    let d = daemon_with_key().await;
    let c = d.client();
    c.create_secret(&secret("gh"), None).await.unwrap();
    c.create_secret(&secret("npm"), None).await.unwrap();
    let before = c
        .list_sandboxes(None, &[], Some(100), None)
        .await
        .unwrap()
        .items
        .len();
    // An unknown name: refused, and no sandbox is left behind.
    let err = c.create_sandbox(&small(&["gh", "nope"])).await.unwrap_err();
    assert_eq!(err.status(), Some(404), "{err}");
    assert!(err.to_string().contains("nope"), "{err}");
    let err = c.create_sandbox(&small(&["bad name"])).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    let after = c
        .list_sandboxes(None, &[], Some(100), None)
        .await
        .unwrap()
        .items
        .len();
    assert_eq!(before, after);

    let id = c.create_sandbox(&small(&["gh"])).await.unwrap().id;
    // The CA's name, serial and key (its signature is randomised at each boot).
    const CA_ID: &str = "openssl x509 -in /.sandpit/ca.pem -noout -subject -serial -pubkey";
    let ca = sh(&c, &id, CA_ID).await.stdout;
    assert!(ca.contains("BEGIN PUBLIC KEY"), "{ca}");
    assert_eq!(
        c.set_sandbox_secrets(&id, &["npm".into(), "gh".into()])
            .await
            .unwrap(),
        ["gh", "npm"]
    );
    assert_eq!(
        c.set_sandbox_secrets(&id, &["nope".into()])
            .await
            .unwrap_err()
            .status(),
        Some(404)
    );
    assert_eq!(c.sandbox_secrets(&id).await.unwrap(), ["gh", "npm"]);
    // Another owner can neither see nor change this sandbox's secrets.
    let bob = d.owner("bob").await;
    assert_eq!(
        bob.sandbox_secrets(&id).await.unwrap_err().status(),
        Some(404)
    );
    assert_eq!(
        bob.set_sandbox_secrets(&id, &[])
            .await
            .unwrap_err()
            .status(),
        Some(404)
    );

    // Hibernation: processes end and start again on the same files; the secrets and the
    // same CA are there after the wake.
    c.hibernate(&id).await.unwrap();
    assert_eq!(c.sandbox_secrets(&id).await.unwrap(), ["gh", "npm"]);
    c.resume(&id).await.unwrap();
    assert_eq!(c.sandbox_secrets(&id).await.unwrap(), ["gh", "npm"]);
    assert_eq!(sh(&c, &id, CA_ID).await.stdout, ca);
    let env = sh(&c, &id, "echo $SSL_CERT_FILE").await;
    assert_eq!(env.stdout.trim(), "/.sandpit/ca-bundle.pem");

    // A fork's copies may use the same secrets, each with a CA of its own.
    let copies = c.fork(&id, &Default::default()).await.unwrap();
    assert_eq!(copies.len(), 1);
    let copy = &copies[0].id;
    assert_eq!(c.sandbox_secrets(copy).await.unwrap(), ["gh", "npm"]);
    let copy_ca = sh(&c, copy, CA_ID).await.stdout;
    assert!(copy_ca.contains("BEGIN PUBLIC KEY"), "{copy_ca}");
    assert_ne!(copy_ca, ca);

    // Deleting a secret detaches it everywhere.
    c.delete_secret("npm", None).await.unwrap();
    assert_eq!(c.sandbox_secrets(&id).await.unwrap(), ["gh"]);
    assert_eq!(c.sandbox_secrets(copy).await.unwrap(), ["gh"]);
    assert!(c.set_sandbox_secrets(&id, &[]).await.unwrap().is_empty());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_secrets_are_refused_and_no_ca_is_installed() {
    let d = Daemon::start().await;
    let c = d.client();
    let err = c.create_secret(&secret("gh"), None).await.unwrap_err();
    assert_eq!(err.status(), Some(503), "{err}");
    assert!(err.to_string().contains("key_file"), "{err}");
    let err = c.create_sandbox(&small(&["gh"])).await.unwrap_err();
    assert_eq!(err.status(), Some(503), "{err}");
    let id = c.create_sandbox(&small(&[])).await.unwrap().id;
    let out = sh(
        &c,
        &id,
        "test -e /.sandpit/ca.pem && echo has-ca; echo \"env=$SSL_CERT_FILE\"",
    )
    .await;
    assert_eq!(out.stdout, "env=\n");
    d.shutdown().await;
}

/// A Debian-like root filesystem: dash as /bin/sh and cat with the host libraries they
/// need, merged /usr, and whatever `extra` adds.
fn shell_rootfs(dir: &Path, extra: impl FnOnce(&Path)) {
    rootfs_with_programs(
        dir,
        &[("/bin/dash", "usr/bin/sh"), ("/bin/cat", "usr/bin/cat")],
    );
    for d in ["etc/ssl/certs", ".sandpit"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    std::fs::write(dir.join("etc/greeting"), "hello\n").unwrap();
    extra(dir);
}

fn in_template(template: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        template: Some(template.into()),
        ..small(&[])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_template_gets_its_own_roots_and_the_ca_and_cannot_redirect_them() {
    let d = daemon_with_key().await;
    let c = d.client();
    // Its own roots file.
    let plain = temp_dir("sandpit-broker-tpl-");
    shell_rootfs(plain.path(), |dir| {
        std::fs::write(
            dir.join("etc/ssl/certs/ca-certificates.crt"),
            "# template roots\n",
        )
        .unwrap();
    });
    build_ready(&c, &dir_build("debianish", plain.path())).await;
    let id = c
        .create_sandbox(&in_template("debianish"))
        .await
        .unwrap()
        .id;
    let run = |script: &str| sandpit_api::RunCommandRequest {
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        ..Default::default()
    };
    let out = c
        .run(
            &id,
            &run("echo $SSL_CERT_FILE; cat /.sandpit/ca-bundle.pem"),
        )
        .await
        .unwrap();
    let ca = c
        .run(&id, &run("cat /.sandpit/ca.pem"))
        .await
        .unwrap()
        .stdout;
    assert!(ca.starts_with("-----BEGIN CERTIFICATE-----"), "{ca}");
    assert_eq!(
        out.stdout,
        format!("/.sandpit/ca-bundle.pem\n# template roots\n{ca}")
    );

    // Its roots "file" leads into /sys, and it ships its own /.sandpit/ca-bundle.pem
    // pointing at a file of its own: neither is read nor written through.
    let hostile = temp_dir("sandpit-broker-tpl-");
    shell_rootfs(hostile.path(), |dir| {
        std::os::unix::fs::symlink(
            "/sys/kernel/mm/transparent_hugepage/enabled",
            dir.join("etc/ssl/certs/ca-certificates.crt"),
        )
        .unwrap();
        std::os::unix::fs::symlink("/etc/greeting", dir.join(".sandpit/ca-bundle.pem")).unwrap();
    });
    build_ready(&c, &dir_build("hostile", hostile.path())).await;
    let id = c.create_sandbox(&in_template("hostile")).await.unwrap().id;
    let out = c
        .run(&id, &run("cat /.sandpit/ca-bundle.pem; cat /etc/greeting"))
        .await
        .unwrap();
    let ca = c
        .run(&id, &run("cat /.sandpit/ca.pem"))
        .await
        .unwrap()
        .stdout;
    assert_eq!(out.stdout, format!("{ca}hello\n"));
    d.shutdown().await;
}

/// The audit of sandbox `id` as the API gives it: (raw JSON text, entries).
async fn audit_of(d: &Daemon, id: &str) -> (String, Vec<sandpit_api::NetworkAuditEntry>) {
    let (status, text) = raw(
        d,
        reqwest::Method::GET,
        &format!("/v1/network/audit?sandbox={id}&limit=1000"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let list: sandpit_api::network::NetworkAuditList = serde_json::from_str(&text).unwrap();
    (text, list.items)
}

/// `curl` in the sandbox over HTTPS with the sandbox's own trust store: the body, a
/// newline, the status (000 when no HTTP answer came), a space, curl's exit code.
async fn curl(c: &Client, id: &str, args: &str) -> (String, String) {
    let out = sh(
        c,
        id,
        &format!("curl -sS --max-time 10 -w '\\n%{{http_code}}' {args}; echo \" $?\""),
    )
    .await;
    let (body, tail) = out.stdout.trim_end().rsplit_once('\n').unwrap_or_default();
    assert!(!out.stderr.contains(VALUE), "{}", out.stderr);
    (body.to_string(), tail.to_string())
}

/// The whole path: a sandbox's curl reaches a test HTTPS upstream (in a network namespace
/// the test makes, its certificate issued by a test CA the daemon's `[broker]
/// extra_ca_file` names) through the egress proxy and the broker; names resolve through
/// the daemon's resolver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_path_through_the_egress_proxy() {
    let up = Upstream::start(&[
        ("api.upstream.test", "@2"),
        ("plain.upstream.test", "@3"),
        ("brief.upstream.test", "@4"),
    ]);
    let b = Daemon::builder();
    let mut raw_key = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut raw_key))
        .unwrap();
    let key = write_key(b.data_path(), &raw_key);
    let log_dir = tempfile::tempdir().unwrap();
    let log = log_dir.path().join("daemon.log");
    let d = b
        .config(&upstream_config(&up, "", &key))
        .log(&log)
        .start()
        .await;
    let c = d.client();

    let mut s = secret("full");
    s.hosts = vec!["api.upstream.test".into()];
    c.create_secret(&s, None).await.unwrap();
    let mut req = serde_json::to_value(small(&["full"])).unwrap();
    req["network"] = serde_json::json!({
        "mode": "allowlist",
        "rules": [{"action": "allow", "domain": "*.upstream.test", "ports": [443]}],
    });
    let (status, text) = raw(
        &d,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(&req.to_string()),
    )
    .await;
    assert_eq!(status, 201, "{text}");
    let id = serde_json::from_str::<serde_json::Value>(&text).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let on = |host: &str| {
        up.requests()
            .into_iter()
            .filter(|r| r["host"] == host)
            .collect::<Vec<_>>()
    };

    // Allowed: the sandbox sends no credential (or a wrong one), the upstream gets it.
    let (body, tail) = curl(
        &c,
        &id,
        "-H 'Authorization: Bearer from-the-sandbox' https://api.upstream.test/repos/x",
    )
    .await;
    assert_eq!(tail, "200 0", "{body}");
    let echoed: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(echoed["path"], "/repos/x");
    assert_eq!(echoed["sni"], "api.upstream.test");
    assert_eq!(up.seen_authorization(), [format!("Bearer {VALUE}")]);

    // Refused by method and by path, with the reason, and nothing reaches the upstream.
    for (method, path, reason) in [("DELETE", "/repos/x", "method"), ("GET", "/admin", "path")] {
        let (body, tail) = curl(
            &c,
            &id,
            &format!("-X {method} https://api.upstream.test{path}"),
        )
        .await;
        assert_eq!(tail, "403 0", "{body}");
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["reason"], reason, "{body}");
        assert_eq!(body["secret"], "full", "{body}");
    }
    assert_eq!(on("api.upstream.test").len(), 1, "{:?}", up.requests());
    // Requests of one keep-alive connection are judged one by one.
    let two = sh(
        &c,
        &id,
        "curl -sS --max-time 10 -o /dev/null -o /dev/null -w '%{http_code} %{num_connects}\\n' https://api.upstream.test/repos/a https://api.upstream.test/admin",
    )
    .await;
    assert_eq!(two.stdout, "200 1\n403 0\n", "{}", two.stderr);
    let api = on("api.upstream.test");
    assert_eq!(api.len(), 2, "{api:?}");
    assert_eq!(api[1]["path"], "/repos/a");
    assert_eq!(api[1]["authorization"], format!("Bearer {VALUE}"));

    // The broker's certificate for the bound host is the sandbox CA's, not the upstream's.
    let ca_pem = std::fs::read_to_string(up.ca_file()).unwrap();
    sh(
        &c,
        &id,
        &format!("cat > /tmp/upstream-ca.pem <<'EOF'\n{ca_pem}EOF"),
    )
    .await;
    let (_, tail) = curl(
        &c,
        &id,
        "--cacert /tmp/upstream-ca.pem https://api.upstream.test/repos/x",
    )
    .await;
    assert_eq!(tail, "000 60", "the bound host was not intercepted");
    assert_eq!(on("api.upstream.test").len(), 2);

    // A host without a bound credential passes through untouched: the upstream's own
    // certificate (which the sandbox's trust store does not hold), the sandbox's own
    // header, no credential added.
    let (_, tail) = curl(&c, &id, "https://plain.upstream.test/repos/x").await;
    assert_eq!(
        tail, "000 60",
        "the sandbox CA signed a passed-through host"
    );
    let (body, tail) = curl(
        &c,
        &id,
        "--cacert /tmp/upstream-ca.pem -H 'Authorization: Bearer mine' https://plain.upstream.test/repos/y",
    )
    .await;
    assert_eq!(tail, "200 0", "{body}");
    let (_, tail) = curl(
        &c,
        &id,
        "--cacert /tmp/upstream-ca.pem https://plain.upstream.test/repos/z",
    )
    .await;
    assert_eq!(tail, "200 0");
    let plain = on("plain.upstream.test");
    assert_eq!(plain.len(), 2, "{plain:?}");
    assert_eq!(plain[0]["authorization"], "Bearer mine");
    assert_eq!(plain[1]["authorization"], serde_json::Value::Null);
    let issuer = sh(
        &c,
        &id,
        "openssl s_client -connect plain.upstream.test:443 -servername plain.upstream.test </dev/null 2>/dev/null | openssl x509 -noout -issuer",
    )
    .await;
    assert!(
        issuer.stdout.contains("sandpit test upstream CA"),
        "{issuer:?}"
    );

    // A secret past its expiry: the request is refused and the upstream sees nothing.
    let mut brief = secret("brief");
    brief.hosts = vec!["brief.upstream.test".into()];
    brief.ttl_secs = None;
    brief.expires_at_ms = Some(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
            + 3_000,
    );
    c.create_secret(&brief, None).await.unwrap();
    c.set_sandbox_secrets(&id, &["full".into(), "brief".into()])
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(3_500)).await;
    let (body, tail) = curl(&c, &id, "https://brief.upstream.test/repos/x").await;
    assert_eq!(tail, "403 0", "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["reason"], "expired", "{body}");
    assert!(on("brief.upstream.test").is_empty(), "{:?}", up.requests());
    assert_eq!(up.seen_authorization().len(), 3);

    // The audit: each connection, with what it carried, and never the value.
    let mut entries = Vec::new();
    for _ in 0..50 {
        let (text, items) = audit_of(&d, &id).await;
        assert!(!text.contains(VALUE), "{text}");
        entries = items
            .into_iter()
            .filter(|e| e.protocol == "tcp")
            .collect::<Vec<_>>();
        if entries.len() >= 10 && entries.iter().all(|e| e.ended_at_ms.is_some()) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let to = |host: &str| {
        entries
            .iter()
            .filter(|e| e.dest_name.as_deref() == Some(host))
            .collect::<Vec<_>>()
    };
    let (api, plain, brief) = (
        to("api.upstream.test"),
        to("plain.upstream.test"),
        to("brief.upstream.test"),
    );
    assert_eq!(
        (api.len(), plain.len(), brief.len()),
        (5, 4, 1),
        "{entries:#?}"
    );
    for e in entries.iter() {
        assert_eq!(e.verdict, sandpit_api::network::Verdict::Allow, "{e:?}");
        assert_eq!(e.dest_port, 443);
        assert!(e.ended_at_ms.is_some(), "{e:?}");
    }
    // Intercepted connections count what went to the upstream: the allowed requests
    // went there and back, the refused ones (and the one whose handshake failed) nowhere.
    let mut api = api;
    api.sort_by_key(|e| e.id);
    for (i, e) in api.iter().enumerate() {
        if i == 0 || i == 3 {
            assert!(e.bytes_sent > 0 && e.bytes_received > 0, "{e:?}");
        } else {
            assert_eq!((e.bytes_sent, e.bytes_received), (0, 0), "{e:?}");
        }
    }
    for e in brief.iter() {
        assert_eq!((e.bytes_sent, e.bytes_received), (0, 0), "{e:?}");
    }
    // Passed-through connections count every byte, the handshakes the sandbox gave up
    // on included.
    for e in plain {
        assert!(e.bytes_sent > 0 && e.bytes_received > 0, "{e:?}");
    }

    // Nowhere in the sandbox, nor in the daemon's log.
    let (_, hits) = scan(&c, &id, VALUE).await;
    assert!(hits.is_empty(), "the secret is in {hits:?}");
    c.delete_sandbox(&id).await.unwrap();
    d.shutdown().await;
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("credential broker injected credentials"),
        "{logged}"
    );
    assert!(!logged.contains(VALUE), "the daemon logged the secret");
}

/// A daemon for `up` (its DNS, its test CA trusted for upstreams, `network` added to the
/// `[network]` section) with a key, and the secret `dest`: bound to `allowed.test`, plain
/// HTTP allowed, put in as `Authorization: Bearer`.
async fn dest_daemon(up: &Upstream, network: &str) -> (Daemon, tempfile::TempDir) {
    let b = Daemon::builder();
    let key = write_key(b.data_path(), format!("{KEY_HEX}\n").as_bytes());
    let log_dir = tempfile::tempdir().unwrap();
    let d = b
        .config(&upstream_config(up, network, &key))
        .log(&log_dir.path().join("daemon.log"))
        .start()
        .await;
    let mut s = secret("dest");
    s.hosts = vec!["allowed.test".into()];
    s.path_prefixes = vec![];
    s.allow_http = true;
    d.client().create_secret(&s, None).await.unwrap();
    (d, log_dir)
}

/// A sandbox with the secret `dest` and egress policy `network`; its id.
async fn dest_sandbox(d: &Daemon, network: serde_json::Value) -> String {
    let mut req = serde_json::to_value(small(&["dest"])).unwrap();
    req["network"] = network;
    let (status, text) = raw(
        d,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(&req.to_string()),
    )
    .await;
    assert_eq!(status, 201, "{text}");
    serde_json::from_str::<serde_json::Value>(&text).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Asserts that curl's answer is the broker's refusal for the destination.
fn assert_destination_refused(what: &str, body: &str, tail: &str) {
    assert_eq!(tail, "403 0", "{what}: {body}");
    let r: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|_| panic!("{what}: not JSON: {body}"));
    assert_eq!(r["code"], "credential_refused", "{what}: {r}");
    assert_eq!(r["reason"], "destination", "{what}: {r}");
    assert_eq!(r["secret"], "dest", "{what}: {r}");
}

/// Asserts that no request the upstream servers answered carried the secret, and none came
/// to `other` at all.
fn assert_nothing_reached(up: &Upstream, other: &str) {
    let requests = up.requests();
    assert!(requests.iter().all(|r| r["local"] != other), "{requests:?}");
    assert!(
        up.seen_authorization().iter().all(|a| !a.contains(VALUE)),
        "{requests:?}"
    );
}

/// The normal path still gets the credential: the sandbox resolves the bound host through
/// the daemon's resolver and connects to that address (`scheme`: http or https).
async fn assert_injected_on_the_normal_path(up: &Upstream, c: &Client, id: &str, scheme: &str) {
    let before = up.requests().len();
    let (body, tail) = curl(c, id, &format!("{scheme}://allowed.test/normal")).await;
    assert_eq!(tail, "200 0", "{body}");
    let echoed: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(echoed["local"], up.ip(2), "{echoed}");
    let requests = up.requests();
    assert_eq!(requests.len(), before + 1, "{requests:?}");
    let last = &requests[before];
    assert_eq!(last["local"], up.ip(2), "{last}");
    assert_eq!(last["authorization"], format!("Bearer {VALUE}"), "{last}");
}

/// Open mode lets the sandbox reach any address; naming the bound host in a Host header
/// to another one must not take the credential there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_mode_a_claimed_host_does_not_take_the_credential_to_another_address() {
    let up = Upstream::start(&[("allowed.test", "@2")]);
    let (d, _log) = dest_daemon(&up, "").await;
    let c = d.client();
    let id = dest_sandbox(&d, serde_json::json!({"mode": "open"})).await;
    let other = up.ip2(3);
    let (body, tail) = curl(
        &c,
        &id,
        &format!("-H 'Host: allowed.test' http://{other}/steal"),
    )
    .await;
    assert_destination_refused("plain HTTP, open mode", &body, &tail);
    assert_nothing_reached(&up, &other);
    assert_injected_on_the_normal_path(&up, &c, &id, "http").await;
    d.shutdown().await;
}

/// An allowlist whose CIDR rule covers another address allows the connection whatever
/// name it claims; the credential still goes only where the bound host resolves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cidr_rule_does_not_let_a_claimed_host_take_the_credential_elsewhere() {
    let up = Upstream::start(&[("allowed.test", "@2")]);
    let (d, _log) = dest_daemon(&up, "").await;
    let c = d.client();
    let id = dest_sandbox(
        &d,
        serde_json::json!({
            "mode": "allowlist",
            "rules": [
                {"action": "allow", "domain": "allowed.test", "ports": [80, 443]},
                {"action": "allow", "cidr": format!("{}/28", up.ip2(0)), "ports": [80, 443]},
            ],
        }),
    )
    .await;
    let other = up.ip2(3);
    let (body, tail) = curl(
        &c,
        &id,
        &format!("-H 'Host: allowed.test' http://{other}/steal"),
    )
    .await;
    assert_destination_refused("plain HTTP, CIDR rule", &body, &tail);
    assert_nothing_reached(&up, &other);
    // The address is allowed: a request of its own (no bound name) is carried.
    let (body, tail) = curl(&c, &id, &format!("http://{other}/own")).await;
    assert_eq!(tail, "200 0", "{body}");
    assert_injected_on_the_normal_path(&up, &c, &id, "http").await;
    d.shutdown().await;
}

/// Over HTTPS the bound name in the SNI, sent to another address whose server holds a
/// certificate valid for that name (issued by a CA the daemon trusts for upstreams): the
/// certificate check would pass, the destination check must not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_to_another_address_with_a_valid_certificate_gets_no_credential() {
    let up = Upstream::start(&[("allowed.test", "@2")]);
    let (d, _log) = dest_daemon(&up, "").await;
    let c = d.client();
    let other = up.ip2(3);
    // The other address's server does prove the name with a certificate of the CA the
    // daemon trusts (checked from the host, straight into the test's namespace).
    let direct = std::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .arg("--cacert")
        .arg(up.ca_file())
        .args([
            "--resolve",
            &format!("allowed.test:443:{other}"),
            "https://allowed.test/direct",
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&direct.stdout),
        "200",
        "{}",
        String::from_utf8_lossy(&direct.stderr)
    );
    let open = dest_sandbox(&d, serde_json::json!({"mode": "open"})).await;
    let cidr = dest_sandbox(
        &d,
        serde_json::json!({
            "mode": "allowlist",
            "rules": [
                {"action": "allow", "domain": "allowed.test", "ports": [443]},
                {"action": "allow", "cidr": format!("{}/28", up.ip2(0)), "ports": [443]},
            ],
        }),
    )
    .await;
    for (what, id) in [("open mode", &open), ("CIDR rule", &cidr)] {
        let (body, tail) = curl(
            &c,
            id,
            &format!("--resolve allowed.test:443:{other} https://allowed.test/steal"),
        )
        .await;
        assert_destination_refused(what, &body, &tail);
        let reached: Vec<_> = up
            .requests()
            .into_iter()
            .filter(|r| r["local"] == other && r["path"] != "/direct")
            .collect();
        assert!(reached.is_empty(), "{what}: {reached:?}");
        assert!(
            up.seen_authorization().iter().all(|a| !a.contains(VALUE)),
            "{what}: {:?}",
            up.requests()
        );
    }
    for id in [&open, &cidr] {
        assert_injected_on_the_normal_path(&up, &c, id, "https").await;
    }
    d.shutdown().await;
}

/// A connection counts against the sandbox's limit from its accept, while the proxy still
/// waits for its first bytes: one over the limit is closed at once and audited once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_waiting_for_its_first_bytes_holds_a_slot() {
    let up = Upstream::start(&[("allowed.test", "@2")]);
    let (d, _log) = dest_daemon(
        &up,
        "peek_timeout_ms = 5000\nmax_connections_per_sandbox = 3",
    )
    .await;
    let c = d.client();
    let id = dest_sandbox(&d, serde_json::json!({"mode": "open"})).await;
    // Three connections that send nothing (the proxy waits for them), then a fourth
    // with a whole request.
    let script = format!(
        r#"
import socket, time
idle = [socket.create_connection(("{ip}", 80), timeout=5) for _ in range(3)]
time.sleep(1)
s = socket.create_connection(("{ip}", 80), timeout=5)
s.sendall(b"GET /fourth HTTP/1.1\r\nHost: {ip}\r\nConnection: close\r\n\r\n")
try:
    got = s.recv(100)
except OSError:
    got = b""
print(got.split(b"\r\n")[0].decode() or "closed")
"#,
        ip = up.ip(2)
    );
    let out = sh(&c, &id, &format!("python3 -c '{script}'")).await;
    assert_eq!(out.stdout.trim(), "closed", "{}", out.stderr);
    assert!(
        up.requests().iter().all(|r| r["path"] != "/fourth"),
        "{:?}",
        up.requests()
    );
    let mut refused = Vec::new();
    for _ in 0..50 {
        let (_, items) = audit_of(&d, &id).await;
        refused = items
            .into_iter()
            .filter(|e| e.rule == "too many open connections for this sandbox")
            .collect();
        if !refused.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].verdict, sandpit_api::network::Verdict::Deny);
    // The idle ones are gone with the script: their slots are free again.
    let (body, tail) = curl(&c, &id, &format!("http://{}/after", up.ip(2))).await;
    assert_eq!(tail, "200 0", "{body}");
    d.shutdown().await;
}

/// Run inside a sandbox (`python3 - ATTACKS_JSON`): each attack opens one connection to
/// `ip`:`port` (over TLS with `sni` when `tls`, the certificate not checked: the sandbox
/// is the attacker; or, with `hello`, only a ClientHello for that name is sent), sends each
/// of its `steps` (hex) and reads after each one response (`"read": "one"`) or everything
/// until the server closes (`"all"`), closes, and waits `pause` seconds. Prints one JSON
/// line per attack: its `name` and the `text` that came back.
const ATTACKER: &str = r#"
import json, socket, ssl, sys, time

def read_one(s, buf):
    while b"\r\n\r\n" not in buf:
        d = s.recv(65536)
        if not d:
            return buf, b""
        buf += d
    head, _, rest = buf.partition(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            n = int(v.strip())
    while len(rest) < n:
        d = s.recv(65536)
        if not d:
            break
        rest += d
    return head + b"\r\n\r\n" + rest[:n], rest[n:]

def read_all(s, buf):
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            buf += d
    except OSError:
        pass
    return buf, b""

for a in json.loads(sys.argv[1]):
    text, error = b"", None
    try:
        s = socket.create_connection((a["ip"], a["port"]), timeout=5)
        if a.get("tls"):
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            s = ctx.wrap_socket(s, server_hostname=a.get("sni"))
        if a.get("hello"):
            into, out = ssl.MemoryBIO(), ssl.MemoryBIO()
            obj = ssl.create_default_context().wrap_bio(into, out, server_hostname=a["hello"])
            try:
                obj.do_handshake()
            except ssl.SSLWantReadError:
                pass
            s.sendall(out.read())
        left = b""
        for step in a["steps"]:
            s.sendall(bytes.fromhex(step["send"]))
            if step["read"] == "one":
                got, left = read_one(s, left)
            else:
                got, left = read_all(s, left)
            text += got
        s.close()
    except Exception as e:
        error = repr(e)
    print(json.dumps({"name": a["name"], "text": text.decode("latin-1"), "error": error}), flush=True)
    time.sleep(a.get("pause", 0))
"#;

/// One connection of [`ATTACKER`]: `steps` are (bytes to send, read everything until the
/// server closes rather than one response).
fn attack(
    name: &str,
    ip: &str,
    port: u16,
    tls: Option<Option<&str>>,
    steps: &[(&[u8], bool)],
) -> serde_json::Value {
    serde_json::json!({
        "name": name,
        "ip": ip,
        "port": port,
        "tls": tls.is_some(),
        "sni": tls.flatten(),
        "steps": steps
            .iter()
            .map(|(bytes, all)| serde_json::json!({"send": hex::encode(bytes), "read": if *all { "all" } else { "one" }}))
            .collect::<Vec<_>>(),
    })
}

/// Runs `attacks` from inside sandbox `id`: each one's name and what came back.
async fn run_attacks(c: &Client, id: &str, attacks: &[serde_json::Value]) -> Vec<(String, String)> {
    let req = sandpit_api::RunCommandRequest {
        argv: vec![
            "python3".into(),
            "-".into(),
            serde_json::Value::Array(attacks.to_vec()).to_string(),
        ],
        stdin: Some(ATTACKER.into()),
        timeout_ms: Some(120_000),
        ..Default::default()
    };
    let out = c.run(id, &req).await.expect("run the attacks");
    let lines: Vec<serde_json::Value> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|_| panic!("{l}: {}", out.stderr)))
        .collect();
    assert_eq!(lines.len(), attacks.len(), "{}\n{}", out.stdout, out.stderr);
    lines
        .iter()
        .map(|l| {
            let text = format!("{} {}", l["text"].as_str().unwrap_or(""), l["error"]);
            (l["name"].as_str().unwrap().to_string(), text)
        })
        .collect()
}

/// Asserts that no request any upstream server got, except at `home`, had a secret's value
/// anywhere in it (any header), and that none of `seen` (what came back to the sandbox)
/// shows it either.
fn assert_secret_only_at(up: &Upstream, home: &str, seen: &[(String, String)]) {
    for r in up.requests() {
        if r["local"] != home {
            assert!(
                !r.to_string().contains(VALUE),
                "the secret reached {}: {r}",
                r["local"]
            );
        }
    }
    for (name, text) in seen {
        assert!(!text.contains(VALUE), "{name}: {text}");
    }
}

/// Whether `text` is (or holds) the broker's refusal of a credential for `reason`.
fn refused_for(text: &str, reason: &str) -> bool {
    text.starts_with("HTTP/1.1 403") && text.contains(&format!("\"reason\":\"{reason}\""))
}

/// A sandbox in open mode with the header-form secret `dest` and the placeholder-form
/// secret `ph` (both bound to `allowed.test`, plain HTTP allowed, the same value).
async fn two_secret_sandbox(d: &Daemon) -> String {
    let mut ph = secret("ph");
    ph.hosts = vec!["allowed.test".into()];
    ph.path_prefixes = vec![];
    ph.allow_http = true;
    ph.inject = InjectSpec::Placeholder;
    d.client().create_secret(&ph, None).await.unwrap();
    let mut req = serde_json::to_value(small(&["dest", "ph"])).unwrap();
    req["network"] = serde_json::json!({"mode": "open"});
    let (status, text) = raw(
        d,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(&req.to_string()),
    )
    .await;
    assert_eq!(status, 201, "{text}");
    serde_json::from_str::<serde_json::Value>(&text).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Plain HTTP to another address in every form a client might name the bound host in:
/// spellings of the Host, the absolute-form target, several Hosts, the bound host named
/// only in a later request of a keep-alive or pipelined connection, an upgrade, CONNECT,
/// a Host past the proxy's peek. None may take a credential to that address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_form_takes_a_credential_to_another_address() {
    let up = Upstream::start(&[("allowed.test", "@2"), ("evil.test", "@@3")]);
    let (d, _log) = dest_daemon(&up, "").await;
    let c = d.client();
    let id = two_secret_sandbox(&d).await;
    let other = up.ip2(3);
    // The sandbox knows evil.test as the other address, through the daemon's resolver.
    let out = sh(&c, &id, "getent hosts evil.test").await;
    assert!(out.stdout.contains(&other), "{}", out.stdout);
    let get = |target: &str, headers: &str| -> Vec<u8> {
        format!("GET {target} HTTP/1.1\r\n{headers}X-Api-Key: SANDPIT_SECRET_ph\r\n\r\n")
            .into_bytes()
    };
    let close =
        |target: &str, headers: &str| get(target, &format!("{headers}Connection: close\r\n"));
    let pad = "a".repeat(17 * 1024);
    let claimed_hosts = [
        "allowed.test",
        "ALLOWED.TEST",
        "allowed.test.",
        "Allowed.Test.:80",
        "allowed.test:8080",
    ];
    let mut attacks = Vec::new();
    let mut expect_destination = Vec::new();
    for h in claimed_hosts {
        let name = format!("Host: {h}");
        attacks.push(attack(
            &name,
            &other,
            80,
            None,
            &[(&get("/steal", &format!("Host: {h}\r\n")), false)],
        ));
        expect_destination.push(name);
    }
    for (name, bytes) in [
        (
            "absolute form, same Host",
            get("http://allowed.test/steal", "Host: allowed.test\r\n"),
        ),
        (
            "Upgrade: websocket",
            get(
                "/ws",
                "Host: allowed.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n",
            ),
        ),
    ] {
        attacks.push(attack(name, &other, 80, None, &[(&bytes, false)]));
        expect_destination.push(name.to_string());
    }
    // Refused before the destination matters: a request may name one host only.
    let two_hosts = "Host: allowed.test, then Host: evil.test";
    attacks.push(attack(
        two_hosts,
        &other,
        80,
        None,
        &[(
            &get("/steal", "Host: allowed.test\r\nHost: evil.test\r\n"),
            false,
        )],
    ));
    // Forms the proxy does not read as the bound host: they may go to the other address,
    // but as the sandbox wrote them, with nothing put in.
    for (name, bytes) in [
        ("absolute form, no Host", close("http://allowed.test/steal", "")),
        ("absolute form, Host: evil.test", close("http://allowed.test/steal", "Host: evil.test\r\n")),
        ("absolute form, Host: the address", close("http://allowed.test/steal", &format!("Host: {other}\r\n"))),
        ("Host: evil.test, then Host: allowed.test", close("/steal", "Host: evil.test\r\nHost: allowed.test\r\n")),
        ("Host: allowed.test:x", close("/steal", "Host: allowed.test:x\r\n")),
        ("Host: allowed%2etest", close("/steal", "Host: allowed%2etest\r\n")),
        ("Host: IDN", "GET /steal HTTP/1.1\r\nHost: allowed.t\u{e9}st\r\nConnection: close\r\nX-Api-Key: SANDPIT_SECRET_ph\r\n\r\n".as_bytes().to_vec()),
        ("folded Host", close("/steal", "X-A: b\r\n Host: allowed.test\r\n")),
        ("Host past the peek", close("/steal", &format!("X-Pad: {pad}\r\nHost: allowed.test\r\n"))),
        ("HTTP/1.0 without Host", b"GET /steal HTTP/1.0\r\nX-Api-Key: SANDPIT_SECRET_ph\r\n\r\n".to_vec()),
        ("CONNECT allowed.test:443", b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\nConnection: close\r\nX-Api-Key: SANDPIT_SECRET_ph\r\n\r\n".to_vec()),
    ] {
        attacks.push(attack(name, &other, 80, None, &[(&bytes, true)]));
    }
    // The bound host only in the second request of a connection that began as another
    // name's (evil.test, the address itself): keep-alive, then pipelined.
    for first_host in ["evil.test".to_string(), other.clone()] {
        let first = get("/first", &format!("Host: {first_host}\r\n"));
        let second = get("/steal", "Host: allowed.test\r\nConnection: close\r\n");
        attacks.push(attack(
            &format!("keep-alive after Host: {first_host}"),
            &other,
            80,
            None,
            &[(&first, false), (&second, true)],
        ));
        let both = [first.clone(), second.clone()].concat();
        attacks.push(attack(
            &format!("pipelined after Host: {first_host}"),
            &other,
            80,
            None,
            &[(&both, true)],
        ));
    }
    let seen = run_attacks(&c, &id, &attacks).await;
    for (name, text) in &seen {
        eprintln!("{name}: {}", text.replace("\r\n", " | "));
    }
    assert_secret_only_at(&up, &up.ip(2), &seen);
    for (name, text) in &seen {
        if expect_destination.contains(name) {
            assert!(refused_for(text, "destination"), "{name}: {text}");
        }
        if name == two_hosts {
            assert!(refused_for(text, "host"), "{name}: {text}");
        }
    }
    assert!(
        up.requests().iter().all(|r| r["local"] != up.ip(2)),
        "{:?}",
        up.requests()
    );
    // The same sandbox's normal path still gets both credentials.
    assert_injected_on_the_normal_path(&up, &c, &id, "http").await;
    d.shutdown().await;
}

/// TLS to another address: the bound host in the SNI in other spellings, no SNI at all
/// (the proxy then names the connection from the sandbox's own lookups), an SNI of a name
/// that does resolve there with the bound host only in the Host header inside. None may
/// take a credential to that address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_server_name_takes_a_credential_to_another_address() {
    let up = Upstream::start(&[("allowed.test", "@2"), ("evil.test", "@@3")]);
    let (d, _log) = dest_daemon(&up, "").await;
    let c = d.client();
    let id = two_secret_sandbox(&d).await;
    let other = up.ip2(3);
    let req = |host: &str| -> Vec<u8> {
        format!("GET /steal HTTP/1.1\r\nHost: {host}\r\nX-Api-Key: SANDPIT_SECRET_ph\r\nConnection: close\r\n\r\n")
            .into_bytes()
    };
    let allowed = req("allowed.test");
    let mut seen = run_attacks(
        &c,
        &id,
        &[attack(
            "no SNI, nothing resolved",
            &other,
            443,
            Some(None),
            &[(&allowed, true)],
        )],
    )
    .await;
    let out = sh(&c, &id, "getent hosts evil.test").await;
    assert!(out.stdout.contains(&other), "{}", out.stdout);
    let mut attacks = Vec::new();
    let mut expect = Vec::new();
    for sni in ["allowed.test", "ALLOWED.TEST", "allowed.test."] {
        let name = format!("SNI {sni}");
        attacks.push(attack(
            &name,
            &other,
            443,
            Some(Some(sni)),
            &[(&allowed, true)],
        ));
        expect.push((name, "destination"));
    }
    attacks.push(attack(
        "SNI allowed.test, Host evil.test",
        &other,
        443,
        Some(Some("allowed.test")),
        &[(&req("evil.test"), true)],
    ));
    expect.push(("SNI allowed.test, Host evil.test".into(), "host"));
    attacks.push(attack(
        "no SNI, evil.test resolved there",
        &other,
        443,
        Some(None),
        &[(&allowed, true)],
    ));
    attacks.push(attack(
        "SNI evil.test, Host allowed.test",
        &other,
        443,
        Some(Some("evil.test")),
        &[(&allowed, true)],
    ));
    attacks.push(attack(
        "SNI the address",
        &other,
        443,
        Some(Some(other.as_str())),
        &[(&allowed, true)],
    ));
    // Plain HTTP on the TLS port and TLS on the HTTP port change nothing.
    attacks.push(attack(
        "plain HTTP to port 443",
        &other,
        443,
        None,
        &[(&allowed, true)],
    ));
    attacks.push(attack(
        "TLS to port 80",
        &other,
        80,
        Some(Some("allowed.test")),
        &[(&allowed, true)],
    ));
    seen.extend(run_attacks(&c, &id, &attacks).await);
    for (name, text) in &seen {
        eprintln!("{name}: {}", text.replace("\r\n", " | "));
    }
    assert_secret_only_at(&up, &up.ip(2), &seen);
    for (name, reason) in &expect {
        let (_, text) = seen.iter().find(|(n, _)| n == name).unwrap();
        assert!(refused_for(text, reason), "{name}: {text}");
    }
    assert_injected_on_the_normal_path(&up, &c, &id, "https").await;
    d.shutdown().await;
}

/// What the daemon's resolver told one sandbox verifies no other's connection: sandbox A
/// is told (by the operator's DNS, with a short TTL) that the bound host is at another
/// address; when the name has moved back, sandbox B naming the host to that address gets
/// no credential there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sandboxs_lookup_verifies_no_other_sandboxs_destination() {
    let up = Upstream::start(&[("allowed.test", "@2")]);
    let (d, _log) = dest_daemon(&up, "").await;
    let c = d.client();
    let other = up.ip2(3);
    let a = dest_sandbox(&d, serde_json::json!({"mode": "open"})).await;
    let b = dest_sandbox(&d, serde_json::json!({"mode": "open"})).await;
    up.set_dns("allowed.test", "@@3", 1);
    // The operator's DNS said so: the credential goes there for A.
    let (body, tail) = curl(&c, &a, "http://allowed.test/a").await;
    assert_eq!(tail, "200 0", "{body}");
    let last = up.requests().pop().unwrap();
    assert_eq!(
        (last["local"].as_str(), last["path"].as_str()),
        (Some(other.as_str()), Some("/a")),
        "{last}"
    );
    assert_eq!(last["authorization"], format!("Bearer {VALUE}"), "{last}");
    up.set_dns("allowed.test", "@2", 1);
    // Past the daemon's cache of the answer (its TTL).
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    for how in [
        format!("-H 'Host: allowed.test' http://{other}/b"),
        format!("--resolve allowed.test:80:{other} http://allowed.test/b"),
    ] {
        let (body, tail) = curl(&c, &b, &how).await;
        assert_destination_refused(&how, &body, &tail);
    }
    let reached: Vec<_> = up
        .requests()
        .into_iter()
        .filter(|r| r["path"] == "/b")
        .collect();
    assert!(reached.is_empty(), "{reached:?}");
    assert_injected_on_the_normal_path(&up, &c, &b, "http").await;
    d.shutdown().await;
}

/// An address the bound host resolved to once stays one of its addresses only for as long
/// as that answer holds (at least a minute): looking up another name of the same address
/// again and again must not keep the old answer alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_names_lookups_do_not_keep_an_old_address_of_the_host() {
    let up = Upstream::start(&[("allowed.test", "@2"), ("evil.test", "@@3")]);
    let (d, _log) = dest_daemon(&up, "").await;
    let c = d.client();
    let other = up.ip2(3);
    let id = dest_sandbox(&d, serde_json::json!({"mode": "open"})).await;
    up.set_dns("allowed.test", "@@3", 1);
    let out = sh(&c, &id, "getent hosts allowed.test").await;
    assert!(out.stdout.contains(&other), "{}", out.stdout);
    up.set_dns("allowed.test", "@2", 1);
    // The daemon remembers an answer for at least 60 s; evil.test (the same address) is
    // looked up all along, past that.
    let start = std::time::Instant::now();
    while start.elapsed() < std::time::Duration::from_secs(66) {
        let out = sh(&c, &id, "getent hosts evil.test").await;
        assert!(out.stdout.contains(&other), "{}", out.stdout);
        tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    }
    let (body, tail) = curl(
        &c,
        &id,
        &format!("-H 'Host: allowed.test' http://{other}/stale"),
    )
    .await;
    let reached: Vec<_> = up
        .requests()
        .into_iter()
        .filter(|r| r["path"] == "/stale")
        .collect();
    assert!(reached.is_empty(), "{reached:?}");
    assert_destination_refused("an old address", &body, &tail);
    assert_injected_on_the_normal_path(&up, &c, &id, "http").await;
    d.shutdown().await;
}

/// On a connection to the bound host's own address, a request whose Host names another
/// host (a second Host header, or one after a "port" that is no port) gets no credential:
/// a front end that serves many hosts at that address (a CDN) may route by what the broker
/// did not check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_naming_another_host_gets_no_credential_at_the_hosts_address() {
    let up = Upstream::start(&[("allowed.test", "@2"), ("evil.test", "@@3")]);
    let (d, _log) = dest_daemon(&up, "").await;
    let c = d.client();
    let id = two_secret_sandbox(&d).await;
    let home = up.ip(2);
    let out = sh(&c, &id, "getent hosts allowed.test").await;
    assert!(out.stdout.contains(&home), "{}", out.stdout);
    let req = |hosts: &str| -> Vec<u8> {
        format!("GET /vhost HTTP/1.1\r\n{hosts}X-Api-Key: SANDPIT_SECRET_ph\r\nConnection: close\r\n\r\n")
            .into_bytes()
    };
    let mut attacks = Vec::new();
    for (name, hosts) in [
        (
            "Host: allowed.test, then Host: evil.test",
            "Host: allowed.test\r\nHost: evil.test\r\n",
        ),
        (
            "Host: allowed.test:80@evil.test",
            "Host: allowed.test:80@evil.test\r\n",
        ),
        (
            "Host: allowed.test:evil.test",
            "Host: allowed.test:evil.test\r\n",
        ),
    ] {
        attacks.push(attack(name, &home, 80, None, &[(&req(hosts), true)]));
        attacks.push(attack(
            &format!("TLS, {name}"),
            &home,
            443,
            Some(Some("allowed.test")),
            &[(&req(hosts), true)],
        ));
    }
    // A first request that rightly gets the credential, then one naming another host on
    // the same connection: one after the other, and pipelined.
    let first = b"GET /first HTTP/1.1\r\nHost: allowed.test\r\n\r\n".to_vec();
    let second = req("Host: evil.test\r\n");
    let both = [first.clone(), second.clone()].concat();
    let later = [
        "keep-alive",
        "TLS, keep-alive",
        "pipelined",
        "TLS, pipelined",
    ];
    for (name, port, tls, steps) in [
        (
            later[0],
            80,
            None,
            vec![(&first[..], false), (&second[..], true)],
        ),
        (
            later[1],
            443,
            Some(Some("allowed.test")),
            vec![(&first[..], false), (&second[..], true)],
        ),
        (later[2], 80, None, vec![(&both[..], true)]),
        (
            later[3],
            443,
            Some(Some("allowed.test")),
            vec![(&both[..], true)],
        ),
    ] {
        attacks.push(attack(name, &home, port, tls, &steps));
    }
    let seen = run_attacks(&c, &id, &attacks).await;
    for (name, text) in &seen {
        eprintln!("{name}: {}", text.replace("\r\n", " | "));
    }
    let reached: Vec<_> = up
        .requests()
        .into_iter()
        .filter(|r| r["path"] == "/vhost" && r.to_string().contains(VALUE))
        .collect();
    assert!(reached.is_empty(), "{reached:#?}");
    for (name, text) in &seen {
        if later.contains(&name.as_str()) {
            let (one, two) = text.split_at(text.find("HTTP/1.1 403").unwrap_or(0));
            assert!(one.starts_with("HTTP/1.1 200"), "{name}: {text}");
            assert!(refused_for(two, "host"), "{name}: {text}");
        } else {
            assert!(refused_for(text, "host"), "{name}: {text}");
        }
    }
    let firsts = up
        .requests()
        .into_iter()
        .filter(|r| r["path"] == "/first")
        .count();
    assert_eq!(firsts, later.len(), "{:?}", up.requests());
    assert_injected_on_the_normal_path(&up, &c, &id, "https").await;
    d.shutdown().await;
}

/// Every way a proxied connection ends gives its sandbox's slot back: refused by the
/// policy (an address, a name elsewhere), idle past the peek, closed at once, a TLS hello
/// and gone, refused by the broker, carried with a credential. Each is done more times
/// than the limit, one after another; the credential's requests, last, still get through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_a_connection_ends_gives_its_slot_back() {
    let up = Upstream::start(&[("allowed.test", "@2")]);
    let (d, _log) = dest_daemon(
        &up,
        "peek_timeout_ms = 300\nmax_connections_per_sandbox = 2",
    )
    .await;
    let c = d.client();
    let id = dest_sandbox(
        &d,
        serde_json::json!({
            "mode": "allowlist",
            "rules": [{"action": "allow", "domain": "allowed.test", "ports": [80, 443]}],
        }),
    )
    .await;
    let (home, other) = (up.ip(2), up.ip2(3));
    let out = sh(&c, &id, "getent hosts allowed.test").await;
    assert!(out.stdout.contains(&home), "{}", out.stdout);
    let req = |method: &str, host: &str, path: &str| -> Vec<u8> {
        format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
            .into_bytes()
    };
    let kinds: Vec<(&str, serde_json::Value)> = vec![
        (
            "policy: an address",
            attack("", &other, 80, None, &[(&req("GET", &other, "/x"), true)]),
        ),
        (
            "policy: a name elsewhere",
            attack(
                "",
                &other,
                80,
                None,
                &[(&req("GET", "allowed.test", "/x"), true)],
            ),
        ),
        (
            "idle past the peek",
            attack("", &other, 80, None, &[(b"", true)]),
        ),
        ("closed at once", attack("", &home, 80, None, &[])),
        ("TLS hello, then gone", {
            let mut a = attack("", &home, 443, None, &[]);
            a["hello"] = "allowed.test".into();
            a
        }),
        (
            "broker: method refused",
            attack(
                "",
                &home,
                80,
                None,
                &[(&req("DELETE", "allowed.test", "/x"), true)],
            ),
        ),
        (
            "credential put in",
            attack(
                "",
                &home,
                80,
                None,
                &[(&req("GET", "allowed.test", "/slot"), true)],
            ),
        ),
        (
            "TLS, credential put in",
            attack(
                "",
                &home,
                443,
                Some(Some("allowed.test")),
                &[(&req("GET", "allowed.test", "/slot"), true)],
            ),
        ),
    ];
    let mut attacks = Vec::new();
    for (name, a) in &kinds {
        for n in 0..3 {
            let mut a = a.clone();
            a["name"] = format!("{name} #{n}").into();
            a["pause"] = 0.2.into();
            attacks.push(a);
        }
    }
    let seen = run_attacks(&c, &id, &attacks).await;
    for (name, text) in &seen {
        eprintln!("{name}: {}", text.lines().next().unwrap_or(""));
        if name.starts_with("policy") {
            assert!(text.starts_with("HTTP/1.1 403"), "{name}: {text}");
        }
        if name.starts_with("broker") {
            assert!(refused_for(text, "method"), "{name}: {text}");
        }
        if name.contains("credential put in") {
            assert!(text.starts_with("HTTP/1.1 200"), "{name}: {text}");
        }
    }
    let injected = up
        .seen_authorization()
        .iter()
        .filter(|a| a.contains(VALUE))
        .count();
    assert_eq!(injected, 6, "{:?}", up.requests());
    let (_, items) = audit_of(&d, &id).await;
    let over: Vec<_> = items
        .iter()
        .filter(|e| e.rule == "too many open connections for this sandbox")
        .collect();
    assert!(over.is_empty(), "{over:?}");
    d.shutdown().await;
}
