//! `sandpit-modelsim`: the scripted model server as a process, for tests that run it in a
//! network namespace of their own (`ip netns exec NS sandpit-modelsim --listen ...`).
#![forbid(unsafe_code)]

use clap::Parser;
use sandpit_modelsim::{Config, ModelServer, Script, TestCa, TlsIdentity};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

/// Serves a script as OpenAI Chat Completions, Anthropic Messages and OpenAI Responses.
#[derive(Parser)]
#[command(name = "sandpit-modelsim")]
struct Args {
    /// Address to listen on, e.g. 10.200.0.1:443 (port 0 picks one; the line printed on
    /// stdout says which).
    #[arg(long)]
    listen: SocketAddr,
    /// The script: a JSON file with `turns` (see the crate's README).
    #[arg(long)]
    script: PathBuf,
    /// Serve HTTPS with this certificate chain (PEM, leaf first); needs --tls-key.
    #[arg(long, requires = "tls_key", conflicts_with = "tls_generate")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve HTTPS with a new test CA and leaf, written as ca.pem, cert.pem, key.pem into
    /// this directory before listening.
    #[arg(long)]
    tls_generate: Option<PathBuf>,
    /// Names (DNS or IP) the generated leaf is for; the listen IP and localhost if none.
    #[arg(long = "tls-name")]
    tls_names: Vec<String>,
    /// Append every request received to this JSON lines file.
    #[arg(long)]
    log: Option<PathBuf>,
    /// Answer 401 to model requests without this key (x-api-key or bearer token).
    #[arg(long, env = "MODELSIM_API_KEY")]
    api_key: Option<String>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandpit-modelsim: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = format!("sandpit-modelsim: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                msg.push_str(&format!(": {s}"));
                source = s.source();
            }
            eprintln!("{msg}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), sandpit_modelsim::ModelSimError> {
    let script = Script::from_file(&args.script)?;
    let mut config = Config::new(args.listen, script);
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        config = config.tls(TlsIdentity::from_files(cert, key)?);
    }
    if let Some(dir) = &args.tls_generate {
        let names = if args.tls_names.is_empty() {
            vec![args.listen.ip().to_string(), "localhost".to_string()]
        } else {
            args.tls_names.clone()
        };
        let ca = TestCa::generate(&names)?;
        ca.write_to(dir)?;
        config = config.tls(ca.identity);
    }
    if let Some(log) = args.log {
        config = config.log(log);
    }
    if let Some(key) = args.api_key {
        config = config.api_key(key);
    }
    let server = ModelServer::start(config).await?;
    // The one line on stdout: a test waits for it and reads the port from it.
    println!("sandpit-modelsim listening on {}", server.base_url());
    wait_for_signal().await;
    server.stop().await;
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "SIGTERM handler; only Ctrl-C stops the server");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
