//! `sandpit tls`: certificates for serving the host form (`https://{port}-{id}.{domain}`).

use clap::{Args, Subcommand};
use std::path::PathBuf;

use crate::Ctx;

/// `sandpit tls ...`.
#[derive(Debug, Subcommand)]
pub enum TlsCommand {
    /// Make a local CA (limited to the domain) and a certificate for DOMAIN and *.DOMAIN,
    /// and print how to serve with them, the DNS record and how clients trust the CA.
    Init(InitArgs),
}

/// `sandpit tls init`.
#[derive(Debug, Args)]
pub struct InitArgs {
    /// The domain sandbox ports are named under (`{port}-{id}.DOMAIN`).
    #[arg(long)]
    pub domain: String,
    /// Directory to write ca.pem, cert.pem and key.pem to [default: DATA_DIR/tls].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Replace files a previous run wrote (clients must then trust the new CA).
    #[arg(long)]
    pub force: bool,
}

/// Runs a `sandpit tls` command.
pub fn run(ctx: &Ctx, cmd: TlsCommand) -> anyhow::Result<()> {
    match cmd {
        TlsCommand::Init(args) => {
            let out = args.out.unwrap_or_else(|| ctx.data_dir.join("tls"));
            let files = sandpit_server::tls::init(&args.domain, &out, args.force)?;
            print!("{}", sandpit_server::tls::instructions(&files));
            Ok(())
        }
    }
}
