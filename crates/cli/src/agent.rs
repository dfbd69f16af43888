//! `sandpit agent` (agent runtimes, their runs and run events) and `sandpit workspace` (a
//! sandbox with an agent runtime, made in one call), through the daemon's API.
//!
//! Reading a run's events never affects the run: Ctrl-C stops the reading only and
//! prints how to resume it. The exit code of a followed run says how it ended.

use clap::{Args, Subcommand};
use sandpit_api::network::{NetworkMode, NetworkPolicy, NetworkRule, PortSpec, RuleAction};
use sandpit_api::{
    AgentModelSpec, AgentRun, AgentRunEvent, AgentRuntime, CreateAgentRequest,
    CreateWorkspaceRequest, StartRunRequest,
};
use sandpit_client::{Client, RunFollower};

use crate::util::{
    parse_key_value, print_fields, print_json, print_json_line, print_table, time_since,
};
use crate::{Ctx, LimitArgs};

/// Exit code of a run that succeeded.
pub const EXIT_SUCCEEDED: u8 = 0;
/// Exit code of a run that failed.
pub const EXIT_FAILED: u8 = 1;
/// Exit code of a run that was cancelled.
pub const EXIT_CANCELLED: u8 = 2;
/// Exit code when Ctrl-C stopped the reading (the run goes on).
pub const EXIT_INTERRUPTED: u8 = 130;
/// Characters of an event's summary shown in the human output.
const SUMMARY_CHARS: usize = 160;

/// Where a runtime's harness reaches its model (of `agent create` and `workspace create`).
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// The harness to run: `pi`, `opencode`, `claude` or `codex`.
    #[arg(long, default_value = "pi")]
    harness: String,
    /// Base URL of the model's API (for Chat Completions and Responses the one ending in
    /// /v1, for Anthropic Messages the one before it); the sandbox's egress policy must
    /// allow it.
    #[arg(long, value_name = "URL", env = "SANDPIT_MODEL_URL")]
    model_url: String,
    /// The model id to ask for.
    #[arg(long, value_name = "MODEL", env = "SANDPIT_MODEL")]
    model: String,
    /// Broker secret holding the model's API key (the harness sees only its placeholder).
    #[arg(long, value_name = "SECRET")]
    api_key_secret: Option<String>,
    /// Wire API: chat_completions, responses or anthropic_messages (default: the
    /// harness's own).
    #[arg(long, value_name = "API")]
    model_api: Option<String>,
}

impl ModelArgs {
    fn spec(&self) -> AgentModelSpec {
        AgentModelSpec {
            base_url: self.model_url.clone(),
            model: self.model.clone(),
            api_key_secret: self.api_key_secret.clone(),
            api: self.model_api.clone(),
        }
    }
}

/// `sandpit agent` subcommands.
#[derive(Debug, Subcommand)]
pub enum AgentCommand {
    /// Create an agent runtime in a sandbox (a host-template container); prints its id.
    Create {
        /// Sandbox id.
        sandbox: String,
        #[command(flatten)]
        model: ModelArgs,
        /// Which actions of its runs wait for a person, as JSON, e.g.
        /// `{"egress": true, "credentials": [{"name": "github", "methods": ["POST"]}]}`.
        #[arg(long, value_name = "JSON")]
        approval_policy: Option<String>,
    },
    /// List agent runtimes (of one sandbox, or all of yours).
    Ls {
        /// Only the runtimes of this sandbox.
        sandbox: Option<String>,
    },
    /// Show an agent runtime.
    Show {
        /// Agent runtime id.
        id: String,
    },
    /// End agent runtimes (their active runs are cancelled).
    Rm {
        /// Agent runtime ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Start a run and stream its events; exits 0 if it succeeded, 1 failed, 2 cancelled,
    /// 130 on Ctrl-C (which stops the reading only, never the run).
    Run(RunArgs),
    /// Print a run's events after --after; with --follow, go on until the run ends (exit
    /// codes as for `agent run`).
    Events(EventsArgs),
    /// Cancel a run: its harness is stopped and the run marked cancelled.
    Cancel {
        /// Run id.
        run: String,
    },
}

/// `sandpit agent run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Agent runtime id.
    agent: String,
    /// The task (prompt).
    task: String,
    /// Continue the runtime's last session instead of starting a fresh one.
    #[arg(long = "continue")]
    cont: bool,
    /// A retry with the same key returns the run the first request started.
    #[arg(long, value_name = "KEY")]
    idempotency_key: Option<String>,
    /// End the run as `timed_out` after this many seconds.
    #[arg(long, value_name = "SECS")]
    timeout: Option<u64>,
    /// Print the run's id and return without reading its events.
    #[arg(long, short = 'd')]
    detach: bool,
}

/// `sandpit agent events`.
#[derive(Debug, Args)]
pub struct EventsArgs {
    /// Run id.
    run: String,
    /// Only events with a sequence number above this.
    #[arg(long, value_name = "N", default_value_t = 0)]
    after: i64,
    /// Keep reading until the run ends.
    #[arg(long, short = 'f')]
    follow: bool,
    /// Print at most this many events (without --follow).
    #[arg(long, value_name = "N", conflicts_with = "follow")]
    limit: Option<u32>,
}

/// `sandpit workspace` subcommands.
#[derive(Debug, Subcommand)]
pub enum WorkspaceCommand {
    /// Create a sandbox and an agent runtime in it in one call; prints both ids (no
    /// sandbox is left behind if the runtime is refused).
    Create(Box<WorkspaceArgs>),
}

/// `sandpit workspace create`.
#[derive(Debug, Args)]
pub struct WorkspaceArgs {
    /// Template to start from [default: host].
    #[arg(long)]
    template: Option<String>,
    #[command(flatten)]
    limits: LimitArgs,
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
    /// Metadata label (repeatable).
    #[arg(long = "meta", value_name = "K=V", value_parser = parse_key_value)]
    meta: Vec<(String, String)>,
    /// A secret of yours the broker may inject into the sandbox's requests (repeatable).
    #[arg(long = "secret", value_name = "NAME")]
    secrets: Vec<String>,
    /// Egress mode: none, allowlist or open [default: allowlist with --allow, else the
    /// daemon's].
    #[arg(long, value_name = "MODE", value_parser = parse_mode)]
    network: Option<NetworkMode>,
    /// Allow a destination: DOMAIN or CIDR, optionally :PORT[,PORT|,LOW-HIGH...]
    /// (repeatable), e.g. api.example.com:443 or 10.0.0.5/32:8080.
    #[arg(long = "allow", value_name = "DEST[:PORTS]", value_parser = parse_allow)]
    allow: Vec<NetworkRule>,
    #[command(flatten)]
    model: ModelArgs,
}

/// Parses a network mode.
fn parse_mode(s: &str) -> Result<NetworkMode, String> {
    match s {
        "none" => Ok(NetworkMode::None),
        "allowlist" => Ok(NetworkMode::Allowlist),
        "open" => Ok(NetworkMode::Open),
        _ => Err(format!(
            "unknown network mode {s:?}: use none, allowlist or open"
        )),
    }
}

/// Parses `DEST[:PORTS]` into an allow rule: DEST is a CIDR (or one IPv4 address) or a
/// domain; PORTS is a comma-separated list of ports and LOW-HIGH ranges. The daemon
/// checks the rule's contents again.
fn parse_allow(s: &str) -> Result<NetworkRule, String> {
    let (dest, ports) = match s.rsplit_once(':') {
        Some((d, p)) => (d, Some(p)),
        None => (s, None),
    };
    if dest.is_empty() {
        return Err(format!("expected DOMAIN or CIDR[:PORTS], got {s:?}"));
    }
    let mut specs = Vec::new();
    for p in ports.into_iter().flat_map(|p| p.split(',')) {
        let p = p.trim();
        if let Ok(n) = p.parse::<u16>() {
            specs.push(PortSpec::One(n));
        } else if let Some((lo, hi)) = p.split_once('-')
            && lo.parse::<u16>().is_ok()
            && hi.parse::<u16>().is_ok()
        {
            specs.push(PortSpec::Range(p.to_string()));
        } else {
            return Err(format!("bad port {p:?} in {s:?}"));
        }
    }
    let is_cidr = dest.contains('/') || dest.parse::<std::net::Ipv4Addr>().is_ok();
    let (domain, cidr) = if is_cidr {
        let cidr = if dest.contains('/') {
            dest.to_string()
        } else {
            format!("{dest}/32")
        };
        (None, Some(cidr))
    } else {
        (Some(dest.to_string()), None)
    };
    Ok(NetworkRule {
        action: RuleAction::Allow,
        domain,
        cidr,
        ports: specs,
        overrides: false,
        name: None,
    })
}

/// Runs one `agent` subcommand; the result is the exit code.
pub async fn run(ctx: &Ctx, cmd: AgentCommand) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    match cmd {
        AgentCommand::Create {
            sandbox,
            model,
            approval_policy,
        } => {
            let approval_policy = approval_policy
                .map(|p| serde_json::from_str(&p))
                .transpose()
                .map_err(|e| anyhow::anyhow!("--approval-policy is not JSON: {e}"))?;
            let req = CreateAgentRequest {
                harness: model.harness.clone(),
                model: model.spec(),
                approval_policy,
            };
            let rt = client.create_agent(&sandbox, &req).await?;
            if ctx.json {
                print_json(&rt)?;
            } else {
                println!("{}", rt.id);
            }
            Ok(0)
        }
        AgentCommand::Ls { sandbox } => {
            let items = client.list_agents(sandbox.as_deref()).await?;
            if ctx.json {
                print_json(&items)?;
            } else {
                let rows: Vec<Vec<String>> = items
                    .iter()
                    .map(|r| {
                        vec![
                            r.id.clone(),
                            r.sandbox_id.clone(),
                            r.harness.clone(),
                            r.state.clone(),
                            r.model.model.clone(),
                            time_since(r.created_at_ms),
                        ]
                    })
                    .collect();
                print_table(
                    &["ID", "SANDBOX", "HARNESS", "STATE", "MODEL", "CREATED"],
                    &rows,
                );
            }
            Ok(0)
        }
        AgentCommand::Show { id } => {
            let rt = client.get_agent(&id).await?;
            if ctx.json {
                print_json(&rt)?;
            } else {
                print_fields(&runtime_fields(&rt));
            }
            Ok(0)
        }
        AgentCommand::Rm { ids } => {
            let mut failed = false;
            for id in &ids {
                match client.delete_agent(id).await {
                    Ok(()) => println!("{id}"),
                    Err(e) => {
                        eprintln!("error: {id}: {e}");
                        failed = true;
                    }
                }
            }
            Ok(u8::from(failed))
        }
        AgentCommand::Run(args) => start(ctx, &client, args).await,
        AgentCommand::Events(args) => events(ctx, &client, args).await,
        AgentCommand::Cancel { run } => {
            let r = client.cancel_run(&run).await?;
            if ctx.json {
                print_json(&r)?;
            } else {
                println!("{} {}", r.id, r.state);
            }
            Ok(0)
        }
    }
}

/// Runs one `workspace` subcommand.
pub async fn workspace(ctx: &Ctx, cmd: WorkspaceCommand) -> anyhow::Result<u8> {
    let WorkspaceCommand::Create(args) = cmd;
    let network = match (args.network, args.allow.is_empty()) {
        (None, true) => None,
        (mode, _) => Some(NetworkPolicy {
            mode: mode.unwrap_or(NetworkMode::Allowlist),
            rules: args.allow.clone(),
        }),
    };
    let req = CreateWorkspaceRequest {
        template: args.template.clone(),
        timeout: args.timeout,
        limits: args.limits.spec(),
        env: args.env.iter().cloned().collect(),
        secret_env: args.secret_env.clone(),
        metadata: args.meta.iter().cloned().collect(),
        secrets: args.secrets.clone(),
        network,
        harness: args.model.harness.clone(),
        model: args.model.spec(),
        approval_policy: None,
    };
    let ws = ctx.client()?.create_workspace(&req).await?;
    if ctx.json {
        print_json(&ws)?;
    } else {
        print_fields(&[
            ("SANDBOX", ws.sandbox.id.clone()),
            ("AGENT", ws.agent.id.clone()),
        ]);
    }
    Ok(0)
}

/// `sandpit agent run`.
async fn start(ctx: &Ctx, client: &Client, args: RunArgs) -> anyhow::Result<u8> {
    let req = StartRunRequest {
        task: args.task,
        mode: Some(if args.cont { "continue" } else { "fresh" }.into()),
        idempotency_key: args.idempotency_key,
        timeout_secs: args.timeout,
    };
    let run = client.start_run(&args.agent, &req).await?;
    if args.detach {
        if ctx.json {
            print_json(&run)?;
        } else {
            println!("{}", run.id);
        }
        return Ok(0);
    }
    // The id goes to stderr so that stdout holds only events.
    eprintln!("run {}", run.id);
    follow(ctx, client.follow_run(&run.id, 0)).await
}

/// `sandpit agent events`.
async fn events(ctx: &Ctx, client: &Client, args: EventsArgs) -> anyhow::Result<u8> {
    if args.follow {
        return follow(ctx, client.follow_run(&args.run, args.after)).await;
    }
    let mut after = args.after.max(0);
    let mut left = args.limit.map(u64::from);
    loop {
        let want = left.map(|l| l.min(1000) as u32);
        if want == Some(0) {
            break;
        }
        let page = client
            .run_events(&args.run, after, want.or(Some(1000)))
            .await?;
        if page.events.is_empty() {
            break;
        }
        for e in &page.events {
            print_event(ctx, e)?;
        }
        if let Some(l) = left.as_mut() {
            *l = l.saturating_sub(page.events.len() as u64);
        }
        after = page.next_after;
        if page.complete {
            break;
        }
    }
    Ok(0)
}

/// Prints a run's events as they come until it ends or Ctrl-C; the exit code says which.
async fn follow(ctx: &Ctx, mut f: RunFollower) -> anyhow::Result<u8> {
    let mut interrupt = std::pin::pin!(tokio::signal::ctrl_c());
    loop {
        let next = tokio::select! {
            next = f.next_event() => next?,
            _ = &mut interrupt => {
                eprintln!(
                    "stopped reading; the run goes on. Resume with: sandpit agent events {} --after {} --follow",
                    f.run_id(),
                    f.last_seq()
                );
                return Ok(EXIT_INTERRUPTED);
            }
        };
        match next {
            Some(e) => print_event(ctx, &e)?,
            None => break,
        }
    }
    let Some(run) = f.final_run() else {
        anyhow::bail!("the event stream of run {} ended early", f.run_id());
    };
    report_end(run);
    Ok(match run.state.as_str() {
        "succeeded" => EXIT_SUCCEEDED,
        "cancelled" => EXIT_CANCELLED,
        _ => EXIT_FAILED,
    })
}

/// Says on stderr how a run ended.
fn report_end(run: &AgentRun) {
    match &run.reason {
        Some(reason) => eprintln!("run {} {}: {reason}", run.id, run.state),
        None => eprintln!("run {} {}", run.id, run.state),
    }
}

/// One event: its raw JSON line with `--json`, else a one-line summary.
fn print_event(ctx: &Ctx, e: &AgentRunEvent) -> anyhow::Result<()> {
    if ctx.json {
        return print_json_line(e);
    }
    println!("{:>5}  {:<15} {}", e.seq, e.kind, summary(e));
    Ok(())
}

/// The part of an event's payload a person wants to see, on one line.
fn summary(e: &AgentRunEvent) -> String {
    let p = &e.payload;
    let text = |k: &str| p.get(k).and_then(|v| v.as_str()).map(String::from);
    let s = match e.kind.as_str() {
        "message_delta" | "reasoning_delta" => text("text"),
        "message" => text("text").map(|t| format!("{}: {t}", text("role").unwrap_or_default())),
        "tool_call" => text("name").map(|n| {
            let input = p.get("input").map(|v| v.to_string()).unwrap_or_default();
            format!("{n} {input}")
        }),
        "tool_result" => text("output"),
        "file_change" => text("path"),
        "error" => text("message"),
        "status" => text("status"),
        "end" => text("state").map(|s| match text("reason") {
            Some(r) => format!("{s}: {r}"),
            None => s,
        }),
        _ => None,
    };
    let s = s.unwrap_or_else(|| p.to_string());
    let one_line: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.chars().count() > SUMMARY_CHARS {
        let cut: String = one_line.chars().take(SUMMARY_CHARS).collect();
        format!("{cut}…")
    } else {
        one_line
    }
}

/// The rows of `agent show`.
fn runtime_fields(rt: &AgentRuntime) -> Vec<(&'static str, String)> {
    let mut rows = vec![
        ("ID", rt.id.clone()),
        ("SANDBOX", rt.sandbox_id.clone()),
        ("HARNESS", rt.harness.clone()),
        ("STATE", rt.state.clone()),
        (
            "MODEL",
            format!(
                "{} at {} ({})",
                rt.model.model,
                rt.model.base_url,
                rt.model.api.as_deref().unwrap_or("chat_completions")
            ),
        ),
        ("CREATED", time_since(rt.created_at_ms)),
    ];
    if let Some(secret) = &rt.model.api_key_secret {
        rows.push(("KEY SECRET", secret.clone()));
    }
    if let Some(reason) = &rt.reason {
        rows.push(("REASON", reason.clone()));
    }
    if let Some(ended) = rt.ended_at_ms {
        rows.push(("ENDED", time_since(ended)));
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_rules() {
        let r = parse_allow("10.0.0.5:8080,9000-9010").expect("parses");
        assert_eq!(r.cidr.as_deref(), Some("10.0.0.5/32"));
        assert_eq!(
            r.ports,
            vec![PortSpec::One(8080), PortSpec::Range("9000-9010".into())]
        );
        let r = parse_allow("api.example.com").expect("parses");
        assert_eq!(r.domain.as_deref(), Some("api.example.com"));
        assert!(r.ports.is_empty());
        let r = parse_allow("192.168.0.0/16:443").expect("parses");
        assert_eq!(r.cidr.as_deref(), Some("192.168.0.0/16"));
        assert!(parse_allow(":443").is_err());
        assert!(parse_allow("x.com:http").is_err());
        assert!(parse_allow("x.com:1-x").is_err());
    }

    #[test]
    fn summaries_are_one_short_line() {
        let e = AgentRunEvent {
            seq: 1,
            at_ms: 0,
            kind: "tool_call".into(),
            payload: serde_json::json!({"name": "bash", "input": {"command": "ls\n-l"}}),
        };
        assert_eq!(summary(&e), r#"bash {"command":"ls\n-l"}"#);
        let e = AgentRunEvent {
            seq: 2,
            at_ms: 0,
            kind: "message".into(),
            payload: serde_json::json!({"role": "assistant", "text": "a\nb ".repeat(100)}),
        };
        let s = summary(&e);
        assert!(!s.contains('\n'));
        assert_eq!(s.chars().count(), SUMMARY_CHARS + 1);
        let e = AgentRunEvent {
            seq: 3,
            at_ms: 0,
            kind: "end".into(),
            payload: serde_json::json!({"state": "failed", "reason": "exit 1"}),
        };
        assert_eq!(summary(&e), "failed: exit 1");
    }
}
