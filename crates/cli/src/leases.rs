//! `sandpit lease`: per-user leases through the daemon's API.

use clap::Subcommand;
use sandpit_api::CreateSandboxRequest;
use sandpit_api::leases::Lease;

use crate::util::{parse_key_value, print_json, print_table, time_since};
use crate::{Ctx, SandboxOpts};

/// `sandpit lease` subcommands.
// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum LeaseCommand {
    /// Print USER's sandbox id: the running one, a resumed one, or a new one.
    Acquire {
        /// The user name (1 to 128 characters of A-Z a-z 0-9 . _ @ + -).
        user: String,
        #[command(flatten)]
        sandbox: SandboxOpts,
        /// Seconds until a newly created sandbox expires [default: 300].
        #[arg(long, value_name = "SECS")]
        timeout: Option<u64>,
        /// Environment variable of a newly created sandbox (repeatable).
        #[arg(long, value_name = "K=V", value_parser = parse_key_value)]
        env: Vec<(String, String)>,
    },
    /// List leases.
    Ls,
    /// Release USER's lease and destroy its sandbox.
    Rm {
        /// The user name.
        user: String,
        /// Keep the sandbox running (it stays yours, without a lease).
        #[arg(long)]
        keep: bool,
    },
}

/// Runs one `lease` subcommand.
pub async fn run(ctx: &Ctx, cmd: LeaseCommand) -> anyhow::Result<()> {
    let client = ctx.client()?;
    match cmd {
        LeaseCommand::Acquire {
            user,
            sandbox,
            timeout,
            env,
        } => {
            let req: CreateSandboxRequest =
                crate::sandboxes::create_request(&sandbox, timeout, &env);
            let got = client.acquire(&user, &req).await?;
            if ctx.json {
                return print_json(&got);
            }
            println!("{}", got.sandbox.id);
            Ok(())
        }
        LeaseCommand::Ls => {
            let leases = client.list_leases().await?;
            if ctx.json {
                return print_json(&leases);
            }
            show(&leases);
            Ok(())
        }
        LeaseCommand::Rm { user, keep } => {
            client.release(&user, keep).await?;
            if !ctx.json {
                println!("released {user}");
            }
            Ok(())
        }
    }
}

fn show(leases: &[Lease]) {
    let rows: Vec<Vec<String>> = leases
        .iter()
        .map(|l| {
            vec![
                l.user.clone(),
                l.sandbox_id.clone().unwrap_or_else(|| "-".into()),
                l.status.clone(),
                if l.paused { "yes" } else { "no" }.into(),
                l.runtime.clone(),
                format!("{:.1}s", l.total_usage_seconds),
                time_since(l.last_activity_ms),
                l.lock_version.to_string(),
            ]
        })
        .collect();
    print_table(
        &[
            "USER", "SANDBOX", "STATUS", "PAUSED", "RUNTIME", "USAGE", "ACTIVE", "VERSION",
        ],
        &rows,
    );
}
