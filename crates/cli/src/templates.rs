//! `sandpit template`: build templates through the daemon and follow their progress, list,
//! inspect and remove them; `add` registers a directory in place (local administration).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use sandpit_api::{BuildTemplateRequest, Template, TemplateSourceSpec};
use sandpit_client::Client;

use crate::util::{human_bytes, parse_key_value, print_json, print_table, time_since};
use crate::{Ctx, TemplateCommand};

/// Where a template's root filesystem comes from (exactly one).
#[derive(Debug, Clone, Args)]
#[group(required = true, multiple = false)]
pub struct SourceArgs {
    /// Copy this directory on the daemon's host (symlinks stay symlinks; device nodes,
    /// FIFOs and sockets are skipped).
    #[arg(long, value_name = "PATH")]
    dir: Option<PathBuf>,
    /// Make it with `debootstrap --variant=minbase SUITE` (e.g. bookworm).
    #[arg(long, value_name = "SUITE")]
    debootstrap: Option<String>,
    /// Import an OCI image layout directory or a `docker save` tarball on the daemon's host.
    #[arg(long, value_name = "PATH")]
    oci: Option<PathBuf>,
    /// Use a snapshot's files (id or name) over the template its sandbox ran on: set a
    /// sandbox up with commands, snapshot it, build a template of it.
    #[arg(long, value_name = "SNAPSHOT")]
    snapshot: Option<String>,
}

/// `sandpit template build`.
#[derive(Debug, Args)]
pub struct BuildArgs {
    /// Template name.
    name: String,
    #[command(flatten)]
    source: SourceArgs,
    /// Extra packages for --debootstrap (comma-separated).
    #[arg(
        long,
        value_name = "PKGS",
        value_delimiter = ',',
        requires = "debootstrap"
    )]
    packages: Vec<String>,
    /// Mirror for --debootstrap (http or https).
    #[arg(long, value_name = "URL", requires = "debootstrap")]
    mirror: Option<String>,
    /// Default user of the template's sandboxes: `user` or `root`.
    #[arg(long, value_name = "USER")]
    user: Option<String>,
    /// Default working directory of the template's sandboxes (made when missing).
    #[arg(long, value_name = "DIR")]
    workdir: Option<String>,
    /// Environment variable of the template's sandboxes (repeatable).
    #[arg(long, value_name = "K=V", value_parser = parse_key_value)]
    env: Vec<(String, String)>,
    /// Shell command started in the background in every new sandbox, as the default user.
    #[arg(long, value_name = "CMD")]
    start_cmd: Option<String>,
    /// Shell command run until it exits 0; sandboxes are handed out only after that.
    #[arg(long, value_name = "CMD")]
    ready_cmd: Option<String>,
    /// How long the readiness check may keep failing, in seconds [default: 60].
    #[arg(long, value_name = "SECS")]
    ready_timeout: Option<u32>,
    /// Start the build and return without following it.
    #[arg(long)]
    detach: bool,
}

/// Runs one `template` subcommand.
pub async fn run(ctx: &Ctx, cmd: TemplateCommand) -> anyhow::Result<()> {
    match cmd {
        TemplateCommand::Add { name, rootfs } => {
            crate::admin::template_add(ctx, &name, &rootfs).await
        }
        TemplateCommand::Ls => {
            let templates = ctx.client()?.list_templates().await?;
            if ctx.json {
                return print_json(&templates);
            }
            show(&templates);
            Ok(())
        }
        TemplateCommand::Inspect { name } => {
            let t = ctx.client()?.get_template(&name).await?;
            print_json(&t)
        }
        TemplateCommand::Rm { names } => {
            let client = ctx.client()?;
            for name in names {
                client
                    .delete_template(&name)
                    .await
                    .with_context(|| format!("cannot remove template {name}"))?;
                if !ctx.json {
                    println!("removed template {name}");
                }
            }
            Ok(())
        }
        TemplateCommand::Build(args) => build(ctx, *args).await,
    }
}

fn source_of(args: &BuildArgs) -> anyhow::Result<TemplateSourceSpec> {
    let host_path = |p: &PathBuf| -> anyhow::Result<String> {
        // Relative to where the command runs; the daemon resolves symlinks itself.
        let abs = std::path::absolute(p).with_context(|| format!("bad path {}", p.display()))?;
        abs.to_str()
            .map(str::to_string)
            .with_context(|| format!("{} is not valid UTF-8", abs.display()))
    };
    let s = &args.source;
    Ok(match (&s.dir, &s.debootstrap, &s.oci) {
        (Some(dir), _, _) => TemplateSourceSpec::Dir {
            path: host_path(dir)?,
        },
        (_, Some(suite), _) => TemplateSourceSpec::Debootstrap {
            suite: suite.clone(),
            packages: args.packages.clone(),
            mirror: args.mirror.clone(),
        },
        (_, _, Some(oci)) => TemplateSourceSpec::Oci {
            path: host_path(oci)?,
        },
        _ => match &s.snapshot {
            Some(snapshot) => TemplateSourceSpec::Snapshot {
                snapshot: snapshot.clone(),
                base: None,
            },
            None => anyhow::bail!("one of --dir, --debootstrap, --oci or --snapshot is needed"),
        },
    })
}

async fn build(ctx: &Ctx, args: BuildArgs) -> anyhow::Result<()> {
    let req = BuildTemplateRequest {
        name: args.name.clone(),
        source: source_of(&args)?,
        default_user: args.user.clone(),
        workdir: args.workdir.clone(),
        env: args.env.iter().cloned().collect(),
        start_cmd: args.start_cmd.clone(),
        ready_cmd: args.ready_cmd.clone(),
        ready_timeout_secs: args.ready_timeout,
    };
    let client = ctx.client()?;
    let started = client.build_template(&req).await?;
    if args.detach {
        return if ctx.json {
            print_json(&started)
        } else {
            println!("{}", started.name);
            Ok(())
        };
    }
    let t = follow(&client, &args.name, ctx.json).await?;
    if t.state != "ready" {
        anyhow::bail!(
            "template {} failed to build: {}",
            t.name,
            t.error.as_deref().unwrap_or("no reason given")
        );
    }
    if ctx.json {
        print_json(&t)
    } else {
        println!("{}", t.name);
        Ok(())
    }
}

/// Shows a build's log as it comes (under a spinner on a terminal) until it ends, and
/// returns the template as it then is.
async fn follow(client: &Client, name: &str, quiet: bool) -> anyhow::Result<Template> {
    use indicatif::{ProgressBar, ProgressStyle};
    let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
        let pb = ProgressBar::new_spinner();
        if let Ok(style) = ProgressStyle::with_template("{spinner} {elapsed:>4} {wide_msg}") {
            pb.set_style(style);
        }
        pb.set_message(format!("building {name}"));
        pb.enable_steady_tick(Duration::from_millis(120));
        pb
    });
    let mut offset = 0;
    loop {
        let b = client
            .template_build(name, offset, 25_000)
            .await
            .with_context(|| {
                format!(
                    "lost the build of {name} (it goes on; see `sandpit template inspect {name}`)"
                )
            })?;
        let first = b.lines.first().map(|l| l.offset);
        if b.truncated || first.is_some_and(|f| f > offset) {
            let note = "(earlier lines of the log were dropped)";
            match &bar {
                Some(pb) => pb.println(note),
                None if !quiet => eprintln!("{note}"),
                None => {}
            }
        }
        for line in &b.lines {
            match &bar {
                Some(pb) => {
                    pb.println(&line.text);
                    pb.set_message(line.text.clone());
                }
                None if !quiet => eprintln!("{}", line.text),
                None => {}
            }
        }
        offset = b.next_offset;
        if b.state != "building" {
            break;
        }
    }
    if let Some(pb) = bar {
        pb.finish_and_clear();
    }
    Ok(client.get_template(name).await?)
}

fn describe(t: &Template) -> String {
    match &t.source {
        None => "host".into(),
        Some(TemplateSourceSpec::Dir { path }) => format!("copy of {path}"),
        Some(TemplateSourceSpec::Debootstrap {
            suite, packages, ..
        }) if packages.is_empty() => {
            format!("debootstrap {suite}")
        }
        Some(TemplateSourceSpec::Debootstrap {
            suite, packages, ..
        }) => {
            format!("debootstrap {suite} +{}", packages.join(","))
        }
        Some(TemplateSourceSpec::Oci { path }) => format!("image {path}"),
        Some(TemplateSourceSpec::Snapshot { snapshot, base }) => match base {
            Some(b) => format!("snapshot {snapshot} over {b}"),
            None => format!("snapshot {snapshot}"),
        },
        Some(TemplateSourceSpec::Path { path }) => path.clone(),
    }
}

fn show(templates: &[Template]) {
    let rows: Vec<Vec<String>> = templates
        .iter()
        .map(|t| {
            vec![
                t.name.clone(),
                t.state.clone(),
                describe(t),
                if t.size_bytes > 0 {
                    human_bytes(t.size_bytes)
                } else {
                    "-".into()
                },
                if t.created_at_ms > 0 {
                    time_since(t.created_at_ms)
                } else {
                    "-".into()
                },
            ]
        })
        .collect();
    print_table(&["NAME", "STATE", "SOURCE", "SIZE", "CREATED"], &rows);
}
