//! `sandpit metrics ID`: a sandbox's metrics history through the daemon's API.

use clap::Args;
use sandpit_api::metrics::{MetricSample, SandboxMetrics};

use crate::Ctx;
use crate::usage::parse_when;
use crate::util::{human_bytes, print_json, print_table, time_since};

/// `sandpit metrics`.
#[derive(Debug, Args)]
pub struct MetricsArgs {
    /// Sandbox id.
    pub id: String,
    /// Start of the range: unix milliseconds, or a time ago (10m, 1h) [default: the
    /// oldest sample kept].
    #[arg(long, value_name = "WHEN", value_parser = parse_when)]
    pub start: Option<i64>,
    /// End of the range (exclusive): unix milliseconds, or a time ago [default: now].
    #[arg(long, value_name = "WHEN", value_parser = parse_when)]
    pub end: Option<i64>,
    /// Follow the daemon's pages to the end of the range (a range holds at most 20000
    /// samples per answer).
    #[arg(long)]
    pub all: bool,
}

/// `sandpit metrics ID [--start WHEN] [--end WHEN]`.
pub async fn metrics(ctx: &Ctx, args: MetricsArgs) -> anyhow::Result<()> {
    if let (Some(s), Some(e)) = (args.start, args.end)
        && e < s
    {
        anyhow::bail!("--end is before --start");
    }
    let client = ctx.client()?;
    let mut page = client
        .sandbox_metrics(&args.id, args.start, args.end)
        .await?;
    let mut samples = std::mem::take(&mut page.samples);
    while let (true, Some(next)) = (args.all, page.next_start_ms) {
        page = client
            .sandbox_metrics(&args.id, Some(next), Some(page.end_ms))
            .await?;
        samples.append(&mut page.samples);
    }
    let out = SandboxMetrics { samples, ..page };
    if ctx.json {
        return print_json(&out);
    }
    if out.samples.is_empty() {
        eprintln!(
            "no samples in range (one every {}s while running, kept {}s)",
            out.sample_interval_secs, out.retention_secs
        );
        return Ok(());
    }
    let rows: Vec<Vec<String>> = out.samples.iter().map(row).collect();
    print_table(
        &[
            "TAKEN", "CPU", "MEMORY", "CACHE", "DISK", "NET RX", "NET TX",
        ],
        &rows,
    );
    if let Some(next) = out.next_start_ms {
        eprintln!("more: --start {next} (or --all)");
    }
    Ok(())
}

fn row(s: &MetricSample) -> Vec<String> {
    vec![
        time_since(s.at_ms),
        format!("{:.1}% of {}", s.cpu_used_pct, s.cpu_count),
        format!(
            "{} / {}",
            human_bytes(s.memory_used_bytes),
            human_bytes(s.memory_total_bytes)
        ),
        human_bytes(s.memory_cache_bytes),
        format!(
            "{} / {}",
            human_bytes(s.disk_used_bytes),
            human_bytes(s.disk_total_bytes)
        ),
        human_bytes(s.net_rx_bytes),
        human_bytes(s.net_tx_bytes),
    ]
}
