//! Agent start-up: PID 1 duties, the listener, and the router that serves the Connect
//! services, `/files` and the code interpreter (`/code`).

use crate::config::{AgentConfig, CONFIG_ENV};
use crate::fs::{FilesystemService, FsRoot};
use crate::process::{ProcessService, ProcessTable};
use axum::Router;
use axum::routing::{get, post};
use std::os::fd::FromRawFd;
use std::sync::Arc;
use tokio::signal::unix::{SignalKind, signal};

/// Failures that stop the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("agent configuration: {0}")]
    Config(String),
    /// The config variable is unset or not UTF-8.
    #[error("agent configuration: {} is not set", CONFIG_ENV)]
    ConfigEnv(#[source] std::env::VarError),
    /// The config variable is not the config's JSON.
    #[error("agent configuration: {0}")]
    ConfigJson(#[source] serde_json::Error),
    #[error("agent i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Fs(#[from] crate::fs::FsError),
}

/// Reads the configuration from the environment and runs the agent until it is told to stop.
pub fn run_from_env() -> Result<(), AgentError> {
    let raw = std::env::var(CONFIG_ENV).map_err(AgentError::ConfigEnv)?;
    // SAFETY: still single-threaded; no other thread can read the environment concurrently.
    unsafe { std::env::remove_var(CONFIG_ENV) };
    let cfg: AgentConfig = serde_json::from_str(&raw).map_err(AgentError::ConfigJson)?;
    // One thread keeps an idle sandbox small; file work goes to spawn_blocking threads.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(cfg))
}

/// The router serving one agent (exposed for tests that run the agent in-process).
pub fn router(cfg: Arc<AgentConfig>, table: Arc<ProcessTable>) -> Result<Router, AgentError> {
    let root = Arc::new(FsRoot::open(cfg.clone())?);
    let connect = connectrpc::Router::new()
        .add_service(Arc::new(ProcessService {
            table: table.clone(),
        }))
        .add_service(Arc::new(FilesystemService::new(root.clone())));
    Ok(Router::new()
        .route(
            "/health",
            get(|| async { axum::http::StatusCode::NO_CONTENT }),
        )
        .route("/init", post(init).with_state(cfg.clone()))
        .route(
            "/rusage",
            get(crate::rusage::route).with_state(table.clone()),
        )
        .route(
            "/files",
            get(crate::files_http::download).post(crate::files_http::upload),
        )
        .with_state(root)
        .layer(axum::extract::DefaultBodyLimit::disable())
        .merge(crate::interp::router(cfg))
        // Server streams (a command's output, a directory watch) end at the client's
        // `Connect-Timeout-Ms` with DEADLINE_EXCEEDED, as E2B's envd ends them: its SDKs
        // rely on it (an async `commands.run(..., timeout=2)` raises a TimeoutException).
        .fallback_service(
            connect.into_axum_service().with_deadline_policy(
                connectrpc::DeadlinePolicy::new().with_enforce_on_streams(true),
            ),
        ))
}

/// `POST /init`: applies a caller's env, default user and workdir after start (how a warm,
/// pooled sandbox becomes the caller's); 204, or 400 with the reason.
async fn init(
    axum::extract::State(cfg): axum::extract::State<Arc<AgentConfig>>,
    body: axum::body::Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let req: Result<crate::config::InitRequest, crate::config::InitRequestError> =
        if body.is_empty() {
            Ok(Default::default())
        } else {
            serde_json::from_slice(&body).map_err(Into::into)
        };
    match req.and_then(|r| crate::config::apply_init(&cfg, r)) {
        Ok(()) => axum::http::StatusCode::NO_CONTENT.into_response(),
        Err(e) => (axum::http::StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    }
}

/// Runs the agent: reaper, signal forwarding and the RPC server.
pub async fn run(cfg: AgentConfig) -> Result<(), AgentError> {
    let cfg = Arc::new(cfg);
    // Registered before anything is spawned so that no exit goes unnoticed.
    let sigchld = signal(SignalKind::child())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    // Caught, never acted on: a write past RLIMIT_FSIZE (the process runtime's disk limit)
    // must fail with EFBIG, answered as a full disk, not kill the agent. A caught signal
    // goes back to its default in every command the agent execs.
    let _xfsz = signal(SignalKind::from_raw(libc::SIGXFSZ))?;
    if std::process::id() != 1 {
        // Outside a pid namespace, adopt orphans of our commands so they are reaped here.
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }
    if cfg.mode == crate::config::IsolationMode::Container {
        // Non-dumpable: root in the sandbox (which lacks CAP_SYS_PTRACE) cannot ptrace the
        // agent or read its memory. Commands become dumpable again when they exec.
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    }
    let table = ProcessTable::new(cfg.clone());
    tokio::spawn(crate::process::reap(table.clone(), sigchld));

    let listener = match (cfg.listen_fd, &cfg.listen_path) {
        (Some(fd), _) => {
            // SAFETY: the daemon passed this descriptor for our exclusive use.
            let std_listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
            // dup2 cleared close-on-exec; without it every command would inherit the
            // listener and could accept the daemon's connections in the agent's place.
            nix::fcntl::fcntl(
                &std_listener,
                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
            )
            .map_err(std::io::Error::from)?;
            std_listener.set_nonblocking(true)?;
            tokio::net::UnixListener::from_std(std_listener)?
        }
        (None, Some(path)) => {
            let _ = std::fs::remove_file(path);
            tokio::net::UnixListener::bind(path)?
        }
        (None, None) => return Err(AgentError::Config("no listen_fd or listen_path".into())),
    };
    if cfg.sudo {
        tokio::spawn(crate::sudo::serve(cfg.clone(), table.clone()));
    }
    let app = router(cfg.clone(), table.clone())?;
    tracing::info!("agent serving");
    let server = axum::serve(listener, app);
    tokio::select! {
        r = server => r?,
        _ = sigterm.recv() => terminate(&table).await,
        _ = sigint.recv() => terminate(&table).await,
    }
    Ok(())
}

/// Forwards termination to every command, gives them a moment, then returns (and, as
/// PID 1, takes the whole sandbox down with it).
async fn terminate(_table: &Arc<ProcessTable>) {
    // kill(-1) signals every process we may signal: in a pid namespace, the sandbox's.
    if std::process::id() == 1 {
        // SAFETY: kill with integer arguments touches no memory of ours.
        unsafe { libc::kill(-1, libc::SIGTERM) };
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        // SAFETY: as above.
        unsafe { libc::kill(-1, libc::SIGKILL) };
    }
}

#[cfg(test)]
mod error_tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn config_errors_read_as_before_and_keep_their_cause() {
        let e = AgentError::ConfigEnv(std::env::VarError::NotPresent);
        assert_eq!(
            e.to_string(),
            format!("agent configuration: {CONFIG_ENV} is not set")
        );
        assert!(e.source().is_some());
        let json = serde_json::from_str::<AgentConfig>("{").unwrap_err();
        let shown = json.to_string();
        let e = AgentError::ConfigJson(json);
        assert_eq!(e.to_string(), format!("agent configuration: {shown}"));
        assert!(e.source().is_some());
    }
}
