//! `sandpit bench`: start latency and density measurements (to be written).

/// Options of `sandpit bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Sandboxes to create and delete one after another, for start latency.
    #[arg(long, default_value_t = 50)]
    pub iterations: u32,
    /// Idle sandboxes to hold at once, for density.
    #[arg(long, default_value_t = 100)]
    pub idle: u32,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs the benchmark.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("not implemented yet")
}
