//! Starting a template's services in a new sandbox: its start command runs detached, then
//! its readiness check is retried until it passes or the template's timeout ends.

use super::*;

/// A create's request with the template's settings where the request has none; the
/// request's own env values win over the template's.
pub fn with_defaults(mut req: CreateSandboxRequest, d: &Defaults) -> CreateSandboxRequest {
    if !d.env.is_empty() {
        let mut env = d.env.clone();
        env.extend(std::mem::take(&mut req.env));
        req.env = env;
    }
    if req.workdir.is_none() {
        req.workdir.clone_from(&d.workdir);
    }
    if req.user.is_none() {
        req.user.clone_from(&d.user);
    }
    req
}

/// After a sandbox's agent is up (a new sandbox, a pool member, one woken from
/// hibernation, a fork or restore): starts its template's start command in the background
/// and runs the readiness check until it passes. An error means the sandbox must not be
/// handed out (the caller tears it down).
pub async fn start_services(
    manager: &Manager,
    rec: &SandboxRecord,
    handle: &SandboxHandle,
) -> Result<(), CoreError> {
    if rec.template == "host" {
        return Ok(());
    }
    // The record cannot go while this sandbox exists (a delete would be refused).
    let Some(t) = manager.store.get_template(&rec.template).await? else {
        return Ok(());
    };
    if t.start_cmd.is_none() && t.ready_cmd.is_none() {
        return Ok(());
    }
    let d = &defaults_of(t);
    let conn = manager.conn_for(&rec.id, handle);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !conn.healthy().await {
        if tokio::time::Instant::now() > deadline {
            return Err(CoreError::unavailable(
                "the sandbox agent did not become ready",
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let shell = |cmd: &str| RunCommandRequest {
        argv: vec!["/bin/sh".into(), "-c".into(), cmd.into()],
        env: d.env.clone(),
        cwd: d.workdir.clone(),
        user: d.user.clone(),
        ..Default::default()
    };
    if let Some(cmd) = &d.start_cmd {
        let req = RunCommandRequest {
            background: true,
            tag: Some("template-start".into()),
            ..shell(cmd)
        };
        crate::exec::start(&conn, &req, false)
            .await
            .map_err(|e| CoreError::Unprocessable {
                code: "start_command_failed",
                message: format!(
                    "the start command of template {} could not start: {}",
                    d.template,
                    e.chain()
                ),
            })?;
        tracing::debug!(id = %rec.id, template = %d.template, "start command started");
    }
    if let Some(check) = &d.ready_cmd {
        wait_until_ready(&conn, d, shell(check)).await?;
    }
    Ok(())
}

/// Runs the readiness check until it exits 0, for at most the template's readiness
/// timeout.
pub(crate) async fn wait_until_ready(
    conn: &AgentConn,
    d: &Defaults,
    check: RunCommandRequest,
) -> Result<(), CoreError> {
    let started = tokio::time::Instant::now();
    let deadline = started + d.ready_timeout;
    let mut delay = Duration::from_millis(20);
    let mut last = String::from("it never ran");
    let mut attempts = 0u32;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            break;
        }
        attempts += 1;
        // An attempt may take what is left: E2B's ready commands include plain waits
        // (`sleep 10`, the SDKs' `wait_for_timeout`) that a shorter cap would always kill.
        let req = RunCommandRequest {
            timeout_ms: Some(left.as_millis().max(1) as u64),
            max_output_bytes: Some(64 << 10),
            ..check.clone()
        };
        // The command's own timeout kills it; this one covers an agent that stops answering.
        let ran = tokio::time::timeout(
            left + Duration::from_secs(5),
            crate::exec::run_to_end(conn, &req),
        )
        .await;
        match ran {
            Ok(Ok(r)) if r.exit_code == 0 && !r.timed_out => return Ok(()),
            Ok(Ok(r)) => {
                last = format!(
                    "{}; stdout: {:?}; stderr: {:?}",
                    if r.timed_out {
                        "it timed out".to_string()
                    } else {
                        format!("exit code {}", r.exit_code)
                    },
                    tail(&r.stdout),
                    tail(&r.stderr)
                );
            }
            Ok(Err(e)) => {
                if !conn.healthy().await {
                    return Err(CoreError::unavailable(format!(
                        "the sandbox agent stopped answering during the readiness check: {}",
                        e.chain()
                    )));
                }
                last = e.chain();
            }
            Err(_) => last = "the agent did not answer".into(),
        }
        tokio::time::sleep(
            delay.min(deadline.saturating_duration_since(tokio::time::Instant::now())),
        )
        .await;
        delay = (delay * 2).min(Duration::from_millis(500));
    }
    Err(CoreError::Unprocessable {
        code: "readiness_check_failed",
        message: format!(
            "the readiness check of template {} did not pass within {} s ({attempts} attempts); last: {last}",
            d.template,
            d.ready_timeout.as_secs()
        ),
    })
}

/// The end of a command's output, for an error message.
pub(crate) fn tail(s: &str) -> &str {
    let mut from = s.len().saturating_sub(QUOTED_OUTPUT);
    while !s.is_char_boundary(from) {
        from += 1;
    }
    s[from..].trim_end()
}
