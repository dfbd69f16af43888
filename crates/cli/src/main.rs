//! `sandpit`: the daemon (`serve`), its command-line client, local administration (`keys`,
//! `template add`), and — under other names — the in-sandbox agent and init helper.

mod admin;
mod agent;
mod approvals;
mod cp;
mod exec;
mod leases;
mod lifecycle;
mod metrics;
mod pools;
mod sandboxes;
mod templates;
mod tls;
mod usage;
mod util;
mod volumes;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use sandpit_client::{Client, ClientError};

use crate::util::{parse_duration, parse_key_value, parse_size};

fn main() -> std::process::ExitCode {
    // The same binary is the in-sandbox agent, the supervisor of an agent run's harness
    // and the sandbox init helper.
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let name = std::path::Path::new(&argv0).file_name();
    if name.is_some_and(|n| n == sandpit_abi::SUPERVISOR_ARGV0) {
        // Before anything else: no runtime, no threads, no config read. It runs as the
        // command's user and holds nothing the caller does not.
        let code = sandpit_agent::supervise::main(std::env::args_os().skip(1));
        return ExitCode::from(u8::try_from(code).unwrap_or(u8::MAX));
    }
    if name.is_some_and(|n| n == sandpit_abi::AGENT_ARGV0) {
        return match sandpit_agent::run_from_env() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("sandpit-agent: {e}");
                ExitCode::FAILURE
            }
        };
    }
    // Inside a sandbox that has it, `/usr/local/bin/sudo` leads here: a client that asks
    // the agent, with no privilege of its own.
    if std::path::Path::new(&argv0)
        .file_name()
        .is_some_and(|n| n == sandpit_agent::sudo::ARGV0)
    {
        // A code no process can exit with is a failure, never a success.
        return ExitCode::from(u8::try_from(sandpit_agent::sudo::client_main()).unwrap_or(1));
    }
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == "__sandbox-init")
    {
        return ExitCode::from(sandpit_runtime::init_main() as u8);
    }

    let cli = Cli::parse();
    init_tracing(matches!(cli.command, Command::Serve(_)));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let url = cli.url.clone();
    let result = runtime.block_on(dispatch(cli));
    // Nothing left to wait for: a straggling blocking write must not hold the exit up.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            let unreachable = e.chain().any(|c| {
                c.downcast_ref::<ClientError>()
                    .is_some_and(ClientError::is_connect)
            });
            if unreachable {
                eprintln!(
                    "error: cannot reach the daemon at {url} (is `sandpit serve` running?): {}",
                    e.root_cause()
                );
            } else {
                eprintln!("error: {e:#}");
            }
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr; `RUST_LOG` overrides the default level (info for the daemon, warnings
/// otherwise, so client output stays clean).
fn init_tracing(daemon: bool) {
    use tracing_subscriber::EnvFilter;
    let default = if daemon { "info" } else { "warn" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Self-hosted sandboxes for AI agents.
#[derive(Debug, Parser)]
#[command(name = "sandpit", version, propagate_version = true)]
struct Cli {
    /// URL of the daemon.
    #[arg(long, global = true, help_heading = "Global options", env = "SANDPIT_URL", default_value = sandpit_api::DEFAULT_URL)]
    url: String,
    /// API key (default: the local daemon's <data-dir>/admin.key, when readable).
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "SANDPIT_API_KEY",
        hide_env_values = true
    )]
    api_key: Option<String>,
    /// Print machine-readable JSON instead of tables.
    #[arg(long, global = true, help_heading = "Global options")]
    json: bool,
    /// The daemon's state directory [default: /var/lib/sandpit as root, else ~/.local/share/sandpit].
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "SANDPIT_DATA_DIR"
    )]
    data_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon.
    Serve(ServeArgs),
    /// Create a sandbox and print its id.
    Create(CreateArgs),
    /// List sandboxes.
    Ls(LsArgs),
    /// Show a sandbox (or, without an id, the daemon).
    Info {
        /// Sandbox id.
        id: Option<String>,
    },
    /// Delete sandboxes.
    Rm {
        /// Sandbox ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Make a sandbox expire SECS seconds from now.
    Timeout {
        /// Sandbox id.
        id: String,
        /// Seconds from now.
        secs: u64,
    },
    /// Run a command in a sandbox, streaming its output; exits with its exit code.
    Exec(ExecArgs),
    /// Create a sandbox, run one command in it, delete it; exits with the command's exit code.
    Run(RunArgs),
    /// Copy a file between a sandbox and here: `cp ID:/path LOCAL` or `cp LOCAL ID:/path` (`-` is stdin/stdout).
    Cp {
        /// Source: ID:/path, a local path, or - for stdin.
        src: String,
        /// Destination: ID:/path, a local path (or directory), or - for stdout.
        dst: String,
    },
    /// Manage API keys (local administration: works on the daemon's database directly).
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Build, list, inspect and remove templates.
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Manage warm pools: sandboxes kept started so that matching creates take one at once.
    #[command(subcommand)]
    Pool(PoolCommand),
    /// Manage volumes: named persistent directories with a size limit, mounted into
    /// sandboxes with `create --volume NAME:/PATH[:ro]`.
    #[command(subcommand)]
    Volume(volumes::VolumeCommand),
    /// Pause a sandbox: freeze its processes (memory kept), or with --hibernate end them
    /// and keep only its files.
    Pause {
        /// Sandbox id.
        id: String,
        /// Keep only the files (frees the memory; a resume starts the sandbox again).
        #[arg(long)]
        hibernate: bool,
    },
    /// Resume a paused or hibernated sandbox.
    Resume {
        /// Sandbox id.
        id: String,
    },
    /// Make copies of a sandbox's files as new sandboxes; prints their ids.
    Fork {
        /// Sandbox id.
        id: String,
        /// How many copies.
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
    /// Take, list, check and delete snapshots of sandboxes' files.
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// Measure sandbox start latency and density (runs `sandpit-bench`, installed beside
    /// this binary; `sandpit bench --help` lists its options).
    #[command(disable_help_flag = true)]
    Bench {
        /// Options for `sandpit-bench`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Per-user leases: one warm sandbox per user name, created or resumed on acquire.
    #[command(subcommand)]
    Lease(leases::LeaseCommand),
    /// Usage of the caller in a period (or, with an id, of one sandbox).
    Usage(usage::UsageArgs),
    /// Execution records of a sandbox's commands, newest first.
    Executions(usage::ExecutionsArgs),
    /// A sandbox's metrics history: CPU, memory, disk and network samples in a range.
    Metrics(metrics::MetricsArgs),
    /// Agent runtimes (a coding agent in a sandbox), their runs and run events.
    #[command(subcommand)]
    Agent(agent::AgentCommand),
    /// Workspaces: a sandbox and an agent runtime in it, made in one call.
    #[command(subcommand)]
    Workspace(agent::WorkspaceCommand),
    /// Approvals of agent runs' risky actions: list, approve, deny.
    #[command(subcommand)]
    Approvals(approvals::ApprovalsCommand),
    /// TLS for the host form: `tls init` makes a local CA and a wildcard certificate.
    #[command(subcommand)]
    Tls(tls::TlsCommand),
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7423")]
    listen: SocketAddr,
    /// Accept requests without an API key (loopback addresses only).
    #[arg(long)]
    insecure_no_auth: bool,
    /// Longest timeout a sandbox may be given, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 86_400)]
    max_timeout: u64,
    /// Offer the unisolated `process` runtime (development only: its commands run on the
    /// host as the daemon's user).
    #[arg(long)]
    allow_process_runtime: bool,
    /// Config file (TOML, declares warm pools) [default: DATA_DIR/config.toml if present].
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    /// A per-user lease left in `creating` this long is taken over by the next acquirer.
    #[arg(long, value_name = "SECS", default_value_t = 25)]
    lease_stale_secs: u64,
    /// Serve TLS with this certificate chain (PEM; `sandpit tls init` makes one); needs
    /// --tls-key. Without both the daemon speaks plain HTTP.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The TLS certificate's private key (PEM, mode 0600 or stricter).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
}

/// Resource limits of a sandbox (of `create`, `run` and `pool create`).
#[derive(Debug, Clone, Args)]
struct LimitArgs {
    /// CPU limit in thousandths of a core (1000 = one core).
    #[arg(long, value_name = "MILLIS")]
    cpu: Option<u64>,
    /// Memory limit, in bytes or with a unit (512M, 1G).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    memory: Option<u64>,
    /// Size of the writable disk (512M, 10G).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    disk: Option<u64>,
    /// Most processes the sandbox may have at once.
    #[arg(long, value_name = "N")]
    max_processes: Option<u64>,
}

impl LimitArgs {
    /// The limits as the API takes them (unset ones take the daemon's defaults).
    fn spec(&self) -> sandpit_api::LimitsSpec {
        sandpit_api::LimitsSpec {
            cpu_millis: self.cpu,
            memory_bytes: self.memory,
            disk_bytes: self.disk,
            max_processes: self.max_processes,
        }
    }
}

/// Options a sandbox is created with (shared by `create` and `run`).
#[derive(Debug, Clone, Args)]
struct SandboxOpts {
    /// Template to start from [default: host].
    #[arg(long)]
    template: Option<String>,
    /// `container` (isolated, the default) or `process` (unisolated, development only).
    #[arg(long)]
    runtime: Option<String>,
    #[command(flatten)]
    limits: LimitArgs,
    /// Metadata label (repeatable).
    #[arg(long = "meta", value_name = "K=V", value_parser = parse_key_value)]
    meta: Vec<(String, String)>,
    /// Default working directory of commands [default: /home/user].
    #[arg(long, value_name = "DIR")]
    workdir: Option<String>,
    /// Mount a volume: NAME:/PATH, or NAME:/PATH:ro read-only (repeatable).
    #[arg(long = "volume", short = 'v', value_name = "NAME:/PATH[:ro]", value_parser = volumes::parse_volume)]
    volumes: Vec<sandpit_api::VolumeMountSpec>,
}

#[derive(Debug, Args)]
struct CreateArgs {
    #[command(flatten)]
    sandbox: SandboxOpts,
    /// Seconds until the sandbox expires [default: 300].
    #[arg(long, value_name = "SECS")]
    timeout: Option<u64>,
    /// Environment variable of every command (repeatable).
    #[arg(long, value_name = "K=V", value_parser = parse_key_value)]
    env: Vec<(String, String)>,
    /// Name of an --env variable whose value is secret: never shown by the API, masked in
    /// the events of agent runs (repeatable).
    #[arg(long = "secret-env", value_name = "NAME")]
    secret_env: Vec<String>,
    /// Default user of commands and file operations: `user` or `root` [default: user].
    #[arg(long, value_name = "USER")]
    user: Option<String>,
    /// Start on a snapshot's files (id or name).
    #[arg(long)]
    snapshot: Option<String>,
    /// Pause after this many seconds without API calls (0 = never) [default: the daemon's, 300].
    #[arg(long, value_name = "SECS")]
    idle_timeout: Option<u64>,
    /// What the timeout does: `kill` or `pause` [default: kill].
    #[arg(long, value_name = "ACTION")]
    on_timeout: Option<String>,
    /// Do not resume the sandbox automatically when a call reaches it while paused.
    #[arg(long)]
    no_auto_resume: bool,
}

#[derive(Debug, Args)]
struct LsArgs {
    /// Only sandboxes in this state (creating, running, paused, stopping, stopped, error; comma-separated).
    #[arg(long)]
    state: Option<String>,
    /// Only sandboxes with this metadata label (repeatable; all must match).
    #[arg(long = "meta", value_name = "K=V", value_parser = parse_key_value)]
    meta: Vec<(String, String)>,
    /// Page size.
    #[arg(long, value_name = "N")]
    limit: Option<u32>,
    /// Continue from this cursor (printed by a previous page).
    #[arg(long)]
    cursor: Option<String>,
    /// Follow cursors to list every page.
    #[arg(long)]
    all: bool,
}

/// How a command runs (shared by `exec` and `run`).
#[derive(Debug, Clone, Args)]
struct ExecOpts {
    /// Forward stdin even when it is a terminal.
    #[arg(short, long)]
    interactive: bool,
    /// Run on a pseudo-terminal of this terminal's size (raw mode; with -i, keystrokes go through).
    #[arg(short, long)]
    tty: bool,
    /// `user` (default) or `root`.
    #[arg(short, long)]
    user: Option<String>,
    /// Working directory.
    #[arg(short = 'w', long, value_name = "DIR")]
    cwd: Option<String>,
    /// Environment variable (repeatable).
    #[arg(short, long, value_name = "K=V", value_parser = parse_key_value)]
    env: Vec<(String, String)>,
    /// Kill the command after this long (e.g. 30s, 5m, 1h, 500ms; plain numbers are seconds).
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    timeout: Option<std::time::Duration>,
}

#[derive(Debug, Args)]
struct ExecArgs {
    /// Sandbox id.
    id: String,
    #[command(flatten)]
    opts: ExecOpts,
    /// The program and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    argv: Vec<String>,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    sandbox: SandboxOpts,
    /// Seconds the sandbox lives without the CLI's keepalives [default: 300].
    #[arg(long, value_name = "SECS")]
    sandbox_timeout: Option<u64>,
    #[command(flatten)]
    opts: ExecOpts,
    /// The program and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    argv: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Issue a key and print it (it cannot be shown again).
    Create {
        /// Who the key acts as; sandboxes belong to owners.
        #[arg(long)]
        owner: String,
        /// A label for people.
        #[arg(long, default_value = "")]
        name: String,
        /// A role of the key (repeatable): `approver` may decide approvals when the daemon
        /// requires it (`[approvals] require_approver_role`).
        #[arg(long = "role")]
        roles: Vec<String>,
    },
    /// List keys (never their secrets).
    Ls,
    /// Revoke a key so it no longer authenticates.
    Revoke {
        /// Key id (from `keys ls`).
        id: String,
    },
}

#[derive(Debug, Subcommand)]
enum TemplateCommand {
    /// Build a template (admin key) and follow its progress; Ctrl-C stops following, the
    /// build goes on (`template rm` cancels it).
    Build(Box<templates::BuildArgs>),
    /// List templates (through the daemon).
    Ls,
    /// Show a template: settings, source, size, build state (JSON).
    Inspect {
        /// Template name.
        name: String,
    },
    /// Remove templates (admin key); refused while sandboxes or pools use them.
    Rm {
        /// Template names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Register a root filesystem directory as a template (local administration).
    Add {
        /// Template name.
        name: String,
        /// Root filesystem directory (e.g. made by debootstrap).
        #[arg(long, value_name = "DIR")]
        rootfs: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum SnapshotCommand {
    /// Snapshot a sandbox's files; prints the snapshot's id.
    Create {
        /// Sandbox id.
        id: String,
        /// Name (unique among your snapshots) [default: the id].
        #[arg(long)]
        name: Option<String>,
        /// Store only what changed since the snapshot the sandbox descends from.
        #[arg(long)]
        incremental: bool,
    },
    /// List your snapshots.
    Ls,
    /// Show one snapshot.
    Info {
        /// Snapshot id or name.
        id: String,
    },
    /// Check that a snapshot's stored archives (its whole chain) are intact.
    Verify {
        /// Snapshot id or name.
        id: String,
    },
    /// Delete a snapshot.
    Rm {
        /// Snapshot id or name.
        id: String,
        /// Also delete the incremental snapshots built on it.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Debug, Subcommand)]
enum PoolCommand {
    /// List pools with ready counts and hit/miss counters.
    Ls,
    /// Show one pool.
    Info {
        /// Pool name.
        name: String,
    },
    /// Create a pool (admin key); creates with the same template, runtime and limits take
    /// from it.
    Create {
        /// Pool name.
        name: String,
        /// Idle sandboxes to keep ready.
        #[arg(long)]
        size: u32,
        /// Template [default: host].
        #[arg(long)]
        template: Option<String>,
        /// Runtime [default: the daemon's].
        #[arg(long)]
        runtime: Option<String>,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Change how many idle sandboxes a pool keeps (admin key).
    Resize {
        /// Pool name.
        name: String,
        /// New size.
        size: u32,
    },
    /// Delete a pool and its idle sandboxes (admin key).
    Rm {
        /// Pool name.
        name: String,
    },
}

/// What every subcommand can use.
pub(crate) struct Ctx {
    url: String,
    api_key: Option<String>,
    pub(crate) json: bool,
    pub(crate) data_dir: PathBuf,
}

impl Ctx {
    /// A client of the daemon, authenticating with the chosen or the local admin key.
    pub(crate) fn client(&self) -> anyhow::Result<Client> {
        Client::new(&self.url, self.key())
            .with_context(|| format!("cannot use daemon URL {}", self.url))
    }

    /// The chosen API key, else the local admin key.
    pub(crate) fn key(&self) -> Option<String> {
        match self.api_key.as_deref().map(str::trim) {
            Some(k) if !k.is_empty() => Some(k.to_string()),
            _ => self.local_admin_key(),
        }
    }

    /// The first admin key the local daemon left in its data dir, if this user can read it.
    fn local_admin_key(&self) -> Option<String> {
        sandpit_client::local_admin_key(&self.data_dir)
    }
}

/// Hands `sandpit bench` to the `sandpit-bench` binary beside this one (else on PATH),
/// with the global options, and returns its exit code.
fn run_bench(ctx: &Ctx, args: Vec<std::ffi::OsString>) -> anyhow::Result<u8> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("sandpit-bench")))
        .filter(|p| p.is_file());
    let exe = beside.unwrap_or_else(|| PathBuf::from("sandpit-bench"));
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg("--url")
        .arg(&ctx.url)
        .arg("--data-dir")
        .arg(&ctx.data_dir);
    // Through the environment, so that the key does not show in the process list.
    if let Some(key) = ctx.key() {
        cmd.env("SANDPIT_API_KEY", key);
    }
    if ctx.json {
        cmd.arg("--json");
    }
    let status = cmd.args(args).status().with_context(|| {
        format!(
            "cannot run {} (build it with `cargo build -p sandpit-bench`)",
            exe.display()
        )
    })?;
    Ok(status
        .code()
        .and_then(|c| u8::try_from(c).ok())
        .unwrap_or(1))
}

/// Runs one subcommand; the result is the process's exit code.
async fn dispatch(cli: Cli) -> anyhow::Result<u8> {
    let ctx = Ctx {
        url: cli.url,
        api_key: cli.api_key,
        json: cli.json,
        data_dir: cli
            .data_dir
            .unwrap_or_else(sandpit_client::default_data_dir),
    };
    match cli.command {
        Command::Serve(args) => serve(&ctx, args).await.map(|()| 0),
        Command::Create(args) => sandboxes::create(&ctx, args).await.map(|()| 0),
        Command::Ls(args) => sandboxes::list(&ctx, args).await.map(|()| 0),
        Command::Info { id } => sandboxes::info(&ctx, id.as_deref()).await.map(|()| 0),
        Command::Rm { ids } => sandboxes::remove(&ctx, &ids).await,
        Command::Timeout { id, secs } => sandboxes::set_timeout(&ctx, &id, secs).await.map(|()| 0),
        Command::Exec(args) => exec::exec(&ctx, args).await,
        Command::Run(args) => exec::run(&ctx, args).await,
        Command::Cp { src, dst } => cp::copy(&ctx, &src, &dst).await.map(|()| 0),
        Command::Keys(cmd) => admin::keys(&ctx, cmd).await.map(|()| 0),
        Command::Pool(cmd) => pools::run(&ctx, cmd).await.map(|()| 0),
        Command::Volume(cmd) => volumes::run(&ctx, cmd).await,
        Command::Template(cmd) => templates::run(&ctx, cmd).await.map(|()| 0),
        Command::Bench { args } => run_bench(&ctx, args),
        Command::Pause { id, hibernate } => {
            lifecycle::pause(&ctx, &id, hibernate).await.map(|()| 0)
        }
        Command::Resume { id } => lifecycle::resume(&ctx, &id).await.map(|()| 0),
        Command::Fork { id, count } => lifecycle::fork(&ctx, &id, count).await.map(|()| 0),
        Command::Snapshot(cmd) => lifecycle::snapshot(&ctx, cmd).await.map(|()| 0),
        Command::Lease(cmd) => leases::run(&ctx, cmd).await.map(|()| 0),
        Command::Usage(args) => usage::usage(&ctx, args).await.map(|()| 0),
        Command::Executions(args) => usage::executions(&ctx, args).await.map(|()| 0),
        Command::Metrics(args) => metrics::metrics(&ctx, args).await.map(|()| 0),
        Command::Agent(cmd) => agent::run(&ctx, cmd).await,
        Command::Workspace(cmd) => agent::workspace(&ctx, cmd).await,
        Command::Approvals(cmd) => approvals::run(&ctx, cmd).await,
        Command::Tls(cmd) => tls::run(&ctx, cmd).map(|()| 0),
    }
}

/// `sandpit serve`.
async fn serve(ctx: &Ctx, args: ServeArgs) -> anyhow::Result<()> {
    let self_exe = std::env::current_exe().context("cannot locate the sandpit binary")?;
    sandpit_server::serve(sandpit_server::ServeConfig {
        listen: args.listen,
        data_dir: ctx.data_dir.clone(),
        insecure_no_auth: args.insecure_no_auth,
        max_timeout_secs: args.max_timeout,
        allow_process_runtime: args.allow_process_runtime,
        self_exe,
        config_file: args.config,
        lease_stale_secs: args.lease_stale_secs,
        tls_cert: args.tls_cert,
        tls_key: args.tls_key,
    })
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Clap finds clashing flag names (e.g. two `--user`) only when a subcommand is used;
    /// this checks every one of them up front.
    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn create_takes_a_default_user_and_run_keeps_its_own() {
        let cli = Cli::try_parse_from(["sandpit", "create", "--user", "root", "--env", "A=1"])
            .expect("create parses");
        match cli.command {
            Command::Create(args) => assert_eq!(args.user.as_deref(), Some("root")),
            other => panic!("parsed as {other:?}"),
        }
        let cli = Cli::try_parse_from(["sandpit", "run", "--user", "root", "--", "id"])
            .expect("run parses");
        assert!(matches!(cli.command, Command::Run(_)));
    }
}
