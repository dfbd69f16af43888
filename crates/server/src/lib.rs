//! The sandpit daemon's composition root: the HTTP API (`/v1` and the E2B routes), the
//! ingress to sandbox ports, the listener, the config file and startup. HTTP types live
//! here and nowhere below; the sandbox state machine is `sandpit-core`.

pub mod api;
pub mod config;
pub mod error;
pub mod ingress;
pub mod listener;
pub mod tls;

/// The credential broker lives in its own crate; the daemon composes it.
pub use sandpit_broker as broker;
/// The sandbox state machine and what it owns live in `sandpit-core`.
pub use sandpit_core::{
    access, agent_conn, exec, leases, lifecycle, manager, pools, snapshots, templates, usage,
    volumes,
};
/// Sandbox networking lives in its own crate; the daemon composes it.
pub use sandpit_net as net;

use manager::{Manager, ManagerConfig};
use sandpit_runtime::Runtime;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How `sandpit serve` was asked to run.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// Accept requests without an API key; refused unless `listen` is loopback.
    pub insecure_no_auth: bool,
    pub max_timeout_secs: u64,
    /// Offer the unisolated `process` runtime; off by default because its commands run on
    /// the host with the daemon's privileges.
    pub allow_process_runtime: bool,
    /// The sandpit binary, which is also the agent and the init helper.
    pub self_exe: PathBuf,
    /// Config file; without one, `config.toml` in the data dir is read if it exists.
    pub config_file: Option<PathBuf>,
    /// A lease left in `creating` longer than this is taken over by the next acquirer.
    pub lease_stale_secs: u64,
    /// TLS certificate chain (`--tls-cert`); with `tls_key`, wins over `[tls]`.
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (`--tls-key`), mode 0600 or stricter.
    pub tls_key: Option<PathBuf>,
}

/// Failures that keep the daemon from starting or serving.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A flag refused (a message alone: no underlying error).
    #[error("configuration: {0}")]
    Config(String),
    /// The config file at `path` cannot be parsed or holds a refused setting.
    #[error("configuration: {}: {source}", path.display())]
    ConfigFile {
        path: PathBuf,
        #[source]
        source: config::ConfigError,
    },
    /// A setting of the config file refused after reading it.
    #[error("configuration: {0}")]
    Setting(#[from] config::ConfigError),
    #[error("store: {0}")]
    Store(#[from] sandpit_store::StoreError),
    #[error("runtime: {0}")]
    Runtime(#[from] sandpit_runtime::RuntimeError),
    #[error("networking: {0}")]
    Net(#[from] sandpit_net::NetError),
    #[error("credential broker: {0}")]
    Broker(#[from] sandpit_broker::BrokerError),
    #[error("snapshot storage: {0}")]
    Storage(#[from] sandpit_core::snapshot_store::StorageError),
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    #[error("warm pools: {0}")]
    Pools(#[source] sandpit_core::CoreError),
    #[error("TLS: {0}")]
    Tls(#[from] tls::TlsError),
}

/// Name of the file in the data dir holding the first admin key (mode 0600).
pub const ADMIN_KEY_FILE: &str = "admin.key";

async fn ensure_admin_key(
    store: &sandpit_store::Store,
    data_dir: &std::path::Path,
) -> Result<(), ServerError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join(ADMIN_KEY_FILE);
    // Only a brand-new store gets a key written out; afterwards keys come from `sandpit keys`.
    if !store.list_api_keys().await?.is_empty() {
        return Ok(());
    }
    let (_, key) = store
        .create_api_key(api::pools::ADMIN_OWNER, "first admin key")
        .await?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| ServerError::Io(format!("write {}", path.display()), e))?;
    f.write_all(key.as_bytes())
        .map_err(|e| ServerError::Io(format!("write {}", path.display()), e))?;
    tracing::info!(path = %path.display(), "created the first admin API key");
    Ok(())
}

/// The daemon holds a connection or two per sandbox; a thousand sandboxes need more than
/// the usual soft limit of 1024 descriptors.
fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
    {
        match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "raised the open file limit"),
            Err(e) => tracing::warn!(error = %e, "cannot raise the open file limit"),
        }
    }
}

/// What [`prepare`] builds: the manager, the HTTP application's state, the listener's
/// settings and its TLS (none: plain HTTP).
pub type Prepared = (
    Arc<Manager>,
    api::AppState,
    listener::HttpConfig,
    Option<Arc<rustls::ServerConfig>>,
);

/// Builds the daemon's state: store, runtimes, manager (after reconciling), and returns it
/// with the listener's settings from the config file.
pub async fn prepare(cfg: &ServeConfig) -> Result<Prepared, ServerError> {
    if cfg.insecure_no_auth && !cfg.listen.ip().is_loopback() {
        return Err(ServerError::Config(
            "--insecure-no-auth is only allowed on a loopback address".into(),
        ));
    }
    if cfg.max_timeout_secs == 0 {
        return Err(ServerError::Config(
            "--max-timeout must be at least 1 second".into(),
        ));
    }
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&cfg.data_dir)
            .map_err(|e| ServerError::Io(format!("create {}", cfg.data_dir.display()), e))?;
    }
    raise_fd_limit();
    // Sandbox PID 1s outlive their init helper; as subreaper the daemon collects them.
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let file = match &cfg.config_file {
        Some(p) => config::FileConfig::load(p, true)?,
        None => config::FileConfig::load(&cfg.data_dir.join(config::DEFAULT_CONFIG_FILE), false)?,
    };
    // Read before anything changes on the host: a refused key fails the start cleanly.
    let tls = match tls::resolve(cfg.tls_cert.as_deref(), cfg.tls_key.as_deref(), &file.tls)? {
        Some(files) => {
            let config = tls::server_config(&files)?;
            tracing::info!(cert = %files.cert.display(), "serving TLS");
            Some(config)
        }
        None => None,
    };
    let store = sandpit_store::Store::open(&cfg.data_dir.join("sandpit.db")).await?;
    ensure_admin_key(&store, &cfg.data_dir).await?;
    let mut runtimes: BTreeMap<String, Arc<dyn Runtime>> = BTreeMap::new();
    let harness_dir = file.agents.resolve()?;
    let approvals = file.approvals.resolve()?;
    // From here on the start changes the host (the sandboxes' tmpfs and cgroup, the
    // nftables table): a start that fails undoes it.
    let mut guard = StartGuard::default();
    let container = sandpit_runtime::container::ContainerRuntime::new(
        &cfg.data_dir,
        cfg.self_exe.clone(),
        std::path::Path::new("/sys/fs/cgroup"),
    )?;
    let container = match &harness_dir {
        Some(dir) => {
            tracing::info!(dir = %dir.display(), "agent harnesses bound into host sandboxes");
            container.with_ro_bind(
                dir.clone(),
                sandpit_core::agent_runtime::HARNESS_MOUNT.into(),
            )
        }
        None => container,
    };
    let container: Arc<dyn Runtime> = Arc::new(container);
    guard.runtime = Some(container.clone());
    let last_audit = store.max_audit_id().await?;
    let net = net::Net::start(&file.network, &cfg.data_dir, store.clone(), last_audit)?;
    let container: Arc<dyn Runtime> = match &net {
        Some(n) => Arc::new(net::runtime::NetRuntime::new(container, n.clone())),
        None => container,
    };
    guard.runtime = Some(container.clone());
    runtimes.insert("container".into(), container);
    // Registered even when not offered, so that reconcile can clean up its sandboxes.
    let process =
        sandpit_runtime::process::ProcessRuntime::new(&cfg.data_dir, cfg.self_exe.clone())?;
    runtimes.insert("process".into(), Arc::new(process));
    let volumes = Arc::new(sandpit_runtime::volume::VolumeHost::new(&cfg.data_dir)?);
    let broker = broker::Broker::new(&file.broker, store.clone())
        .await
        .map_err(ServerError::Broker)?;
    let snapshot_store = snapshots::SnapshotStore::open(&file.snapshots, &cfg.data_dir)
        .map_err(ServerError::Storage)?;
    tracing::info!(store = %snapshot_store.describe, "snapshot storage");
    let broker = Arc::new(broker);
    let manager = Manager::new(
        store.clone(),
        runtimes,
        volumes,
        broker.clone(),
        ManagerConfig {
            data_dir: cfg.data_dir.clone(),
            lifecycle: file.lifecycle.clone(),
            max_timeout_secs: cfg.max_timeout_secs,
            default_runtime: "container".into(),
            allow_process_runtime: cfg.allow_process_runtime,
            agents: sandpit_core::agent_runtime::AgentsConfig {
                harness_dir,
                max_run: file.agents.max_run()?,
                event_limits: file.agents.event_limits()?,
                cancel_grace: file.agents.cancel_grace()?,
            },
            pool_limits: file.pool_limits.clone(),
            approvals,
        },
        snapshot_store,
    );
    guard.manager = Some(manager.clone());
    // A credential a run's approval policy gates waits for a person before it is injected.
    broker.set_approval_gate(manager.approval_gate());
    if let Some(n) = &net {
        manager.attach_net(n.clone());
        // Connections to hosts with a bound credential go through the broker; it wants
        // none while it has no key.
        n.set_interceptor(broker.clone());
        // A connection the policy refuses asks the approvals first (when a run's policy
        // gates egress); the approvals API is on this daemon's listener only.
        n.set_approval_gate(manager.approval_gate());
    }
    if let Err(e) = manager.reconcile().await {
        tracing::warn!(error = %e.chain(), "reconcile failed");
    }
    manager.fail_orphaned_runs().await;
    if let Some(n) = &net {
        n.run().await?;
    }
    manager.sweep_snapshot_objects().await;
    if let Err(e) = manager.reconcile_volumes().await {
        tracing::warn!(error = %e.chain(), "reconciling volumes failed");
    }
    manager.templates().recover(&store).await;
    match manager.load_pools(&file.pools).await {
        Ok(()) => {}
        // A config pool over the size limits: the operator must fix the file.
        Err(e @ (sandpit_core::CoreError::Invalid(_) | sandpit_core::CoreError::Conflict(_))) => {
            return Err(ServerError::Pools(e));
        }
        Err(e) => tracing::warn!(error = %e.chain(), "loading warm pools failed"),
    }
    let state = api::AppState {
        manager: manager.clone(),
        store,
        broker,
        no_auth_owner: cfg
            .insecure_no_auth
            .then(|| api::pools::ADMIN_OWNER.to_string()),
        keys: Default::default(),
        leases: Arc::new(leases::Leases::new(leases::LeaseConfig {
            stale_after: Duration::from_secs(cfg.lease_stale_secs),
            ..Default::default()
        })),
        e2b: Arc::new(file.e2b.clone()),
        metrics: file.metrics.clone(),
        ingress: Arc::new(ingress::ProxyConfig {
            listen_port: cfg.listen.port(),
            // A TLS daemon's URLs are https whatever the file says.
            scheme: if tls.is_some() {
                "https".into()
            } else {
                file.proxy.scheme.clone()
            },
            ..file.proxy.clone()
        }),
    };
    guard.disarm();
    Ok((manager, state, file.http, tls))
}

/// What a start has done to the host so far, released if it fails before serving: the
/// releases leave alone whatever live sandboxes of an earlier run still use.
#[derive(Default)]
struct StartGuard {
    runtime: Option<Arc<dyn Runtime>>,
    manager: Option<Arc<Manager>>,
}

impl StartGuard {
    fn disarm(&mut self) {
        self.runtime = None;
        self.manager = None;
    }
}

impl Drop for StartGuard {
    fn drop(&mut self) {
        if let Some(m) = self.manager.take() {
            tracing::info!("start failed: releasing the host resources it took");
            m.release_host();
        } else if let Some(rt) = self.runtime.take() {
            tracing::info!("start failed: releasing the host resources it took");
            rt.release();
        }
    }
}

/// Runs the daemon until SIGTERM or SIGINT. Sandboxes keep running across a restart and
/// are re-adopted by the next start.
pub async fn serve(cfg: ServeConfig) -> Result<(), ServerError> {
    // Bound first: a port in use must fail the start before it has changed the host.
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| ServerError::Io(format!("listen on {}", cfg.listen), e))?;
    let (manager, state, http, tls) = prepare(&cfg).await?;
    tokio::spawn(manager.clone().run_pools());
    state.broker.spawn_refresh();
    usage::start(&manager);
    sandpit_core::metrics_history::start(&manager, state.metrics.clone());
    let ticker = manager.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            ticker.tick().await;
        }
    });
    tracing::info!(listen = %cfg.listen, data_dir = %cfg.data_dir.display(), "sandpit serving");
    let net = manager.net().cloned();
    let shutdown = async move {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut t), Ok(mut i)) => {
                tokio::select! { _ = t.recv() => {}, _ = i.recv() => {} }
            }
            _ => std::future::pending::<()>().await,
        }
        // Live streams would hold the graceful shutdown open forever.
        if let Some(n) = net {
            n.audit.close_streams();
        }
    };
    listener::serve(listener, api::router(state), &http, tls, shutdown).await;
    manager.stop_pools(Duration::from_secs(30)).await;
    manager.drain_teardowns(Duration::from_secs(30)).await;
    manager.usage().flush(Duration::from_secs(10)).await;
    manager.release_host();
    Ok(())
}
