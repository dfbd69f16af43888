//! `sandpit approvals`: the caller's approvals of agent runs' risky actions.

use clap::Subcommand;

use crate::Ctx;
use crate::util::{print_json, print_table, time_since};

/// `sandpit approvals ...`.
#[derive(Debug, Subcommand)]
pub enum ApprovalsCommand {
    /// List approvals (default: the pending ones).
    Ls {
        /// `pending`, `approved`, `denied`, `expired`, `abandoned`, or `all`.
        #[arg(long, default_value = "pending")]
        state: String,
        /// Only this run's.
        #[arg(long)]
        run: Option<String>,
    },
    /// Let the held action through.
    Approve {
        /// Approval id.
        id: String,
        /// Also let the same capability and target through for the rest of the run.
        #[arg(long)]
        for_run: bool,
    },
    /// Refuse the held action; the sandbox is told the reason.
    Deny {
        /// Approval id.
        id: String,
        /// Why (shown inside the sandbox).
        #[arg(long)]
        reason: Option<String>,
    },
}

/// Runs one `approvals` subcommand.
pub async fn run(ctx: &Ctx, cmd: ApprovalsCommand) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let one = match cmd {
        ApprovalsCommand::Ls { state, run } => {
            let state = (state != "all").then_some(state);
            let list = client
                .list_approvals(state.as_deref(), run.as_deref())
                .await?;
            if ctx.json {
                print_json(&list)?;
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|a| {
                        vec![
                            a.id.clone(),
                            a.run_id.clone(),
                            a.state.clone(),
                            a.capability.clone(),
                            a.summary.clone(),
                            time_since(a.created_at_ms),
                        ]
                    })
                    .collect();
                print_table(
                    &["ID", "RUN", "STATE", "CAPABILITY", "SUMMARY", "CREATED"],
                    &rows,
                );
            }
            return Ok(0);
        }
        ApprovalsCommand::Approve { id, for_run } => {
            client
                .approve(&id, Some(if for_run { "run" } else { "once" }))
                .await?
        }
        ApprovalsCommand::Deny { id, reason } => client.deny(&id, reason.as_deref()).await?,
    };
    if ctx.json {
        print_json(&one)?;
    } else {
        println!("{} {}", one.id, one.state);
    }
    Ok(0)
}
