//! `sandpit usage` and `sandpit executions`: metering through the daemon's API.

use clap::Args;
use sandpit_api::usage::{Execution, ExecutionList};

use crate::Ctx;
use crate::util::{human_bytes, now_ms, parse_duration, print_json, print_table, time_since};

/// `sandpit usage`.
#[derive(Debug, Args)]
pub struct UsageArgs {
    /// One sandbox's usage instead of the owner's totals.
    pub id: Option<String>,
    /// Start of the period: unix milliseconds, or a time ago (24h, 30m, 7d).
    #[arg(long, value_name = "WHEN", value_parser = parse_when)]
    pub from: Option<i64>,
    /// End of the period (exclusive): unix milliseconds, or a time ago [default: now].
    #[arg(long, value_name = "WHEN", value_parser = parse_when)]
    pub to: Option<i64>,
    /// Another owner's usage (admin key).
    #[arg(long)]
    pub owner: Option<String>,
}

/// `sandpit executions`.
#[derive(Debug, Args)]
pub struct ExecutionsArgs {
    /// Sandbox id.
    pub id: String,
    /// Page size.
    #[arg(long, value_name = "N")]
    pub limit: Option<u32>,
    /// Continue from this cursor (printed by a previous page).
    #[arg(long)]
    pub cursor: Option<String>,
    /// Follow cursors to list every page.
    #[arg(long)]
    pub all: bool,
}

/// A point in time: unix milliseconds (12 digits or more), else a duration before now.
pub(crate) fn parse_when(s: &str) -> Result<i64, String> {
    let t = s.trim();
    if t.len() >= 12 && t.bytes().all(|b| b.is_ascii_digit()) {
        return t
            .parse()
            .map_err(|_| format!("bad time {s:?}: unix milliseconds out of range"));
    }
    let ago = parse_duration(t)?;
    let ago = i64::try_from(ago.as_millis()).map_err(|_| format!("{s:?} is too long ago"))?;
    Ok(now_ms().saturating_sub(ago))
}

/// `sandpit usage [ID]`.
pub async fn usage(ctx: &Ctx, args: UsageArgs) -> anyhow::Result<()> {
    let client = ctx.client()?;
    if let Some(id) = &args.id {
        let u = client.sandbox_usage(id).await?;
        if ctx.json {
            return print_json(&u);
        }
        let rows = vec![
            vec!["sandbox".into(), u.sandbox_id.clone()],
            vec!["state".into(), u.state.clone()],
            vec!["created".into(), time_since(u.created_at_ms)],
            vec![
                "active".into(),
                format!("{:.1}s of {:.1}s", u.active_seconds, u.wall_seconds),
            ],
            vec!["cpu".into(), format!("{} ms", u.cpu_time_ms)],
            vec!["memory peak".into(), human_bytes(u.memory_peak_bytes)],
            vec![
                "disk used".into(),
                u.disk_used_bytes
                    .map(human_bytes)
                    .unwrap_or_else(|| "-".into()),
            ],
            vec![
                "egress".into(),
                format!("{} ({})", human_bytes(u.egress_bytes), u.egress_note),
            ],
            vec!["executions".into(), u.executions.to_string()],
        ];
        print_table(&["", ""], &rows);
        return Ok(());
    }
    let u = client
        .usage(args.from, args.to, args.owner.as_deref())
        .await?;
    if ctx.json {
        return print_json(&u);
    }
    let mut rows = vec![
        vec!["owner".into(), u.owner.clone()],
        vec!["sandboxes".into(), u.sandboxes.to_string()],
        vec!["active".into(), format!("{:.1}s", u.active_seconds)],
        vec!["cpu".into(), format!("{} ms", u.cpu_time_ms)],
        vec!["executions".into(), u.executions.to_string()],
    ];
    for (reason, t) in &u.log {
        rows.push(vec![
            format!("log: {reason}"),
            format!("{} entries, amount {}", t.count, t.amount),
        ]);
    }
    print_table(&["", ""], &rows);
    Ok(())
}

/// `sandpit executions ID`.
pub async fn executions(ctx: &Ctx, args: ExecutionsArgs) -> anyhow::Result<()> {
    let client = ctx.client()?;
    let mut items = Vec::new();
    let mut cursor = args.cursor.clone();
    let next_cursor = loop {
        let page = client
            .executions(&args.id, args.limit, cursor.as_deref())
            .await?;
        items.extend(page.items);
        match page.next_cursor {
            Some(next) if args.all => cursor = Some(next),
            next => break next,
        }
    };
    if ctx.json {
        return print_json(&ExecutionList { items, next_cursor });
    }
    show(&items);
    if let Some(c) = next_cursor {
        eprintln!("more: --cursor {c}");
    }
    Ok(())
}

fn show(items: &[Execution]) {
    let opt = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|e| {
            let took = match (e.timestamp.started_ms, e.timestamp.ended_ms) {
                (Some(s), Some(end)) => format!("{} ms", end - s),
                _ if e.background => "background".into(),
                _ => "-".into(),
            };
            vec![
                e.execution_id.clone(),
                e.command.clone(),
                time_since(e.timestamp.created_ms),
                took,
                opt(e.resources.cpu_time_ms),
                opt(e.resources.memory_peak_mb),
                e.output
                    .exit_code
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "-".into()),
                human_bytes(e.output.stdout_bytes),
                human_bytes(e.output.stderr_bytes),
            ]
        })
        .collect();
    print_table(
        &[
            "EXECUTION",
            "COMMAND",
            "CREATED",
            "TOOK",
            "CPU MS",
            "MEM MB",
            "EXIT",
            "STDOUT",
            "STDERR",
        ],
        &rows,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_unix_ms_or_a_time_ago() {
        assert_eq!(parse_when("1700000000000").unwrap(), 1_700_000_000_000);
        let before = now_ms();
        let t = parse_when("1h").unwrap();
        assert!(t <= before - 3_600_000 + 1000 && t >= before - 3_600_000 - 60_000);
        assert!(parse_when("yesterday").is_err());
        assert!(parse_when("99999999999999999999999").is_err());
    }
}
