//! `sandpit volume`: named persistent volumes through the daemon's API, and the
//! `--volume NAME:/PATH[:ro]` option of `create` and `run`.

use clap::Subcommand;
use sandpit_api::{Volume, VolumeMountSpec};

use crate::Ctx;
use crate::util::{human_bytes, parse_size, print_json, print_table, time_since};

/// `sandpit volume` subcommands.
#[derive(Debug, Subcommand)]
pub enum VolumeCommand {
    /// Create a volume (an empty directory of at most SIZE bytes).
    Create {
        /// Volume name: [a-z0-9_-], starting with a letter or digit.
        name: String,
        /// Size limit (64M, 10G); writes past it fail with "No space left on device".
        #[arg(long, value_name = "SIZE", value_parser = parse_size)]
        size: u64,
    },
    /// List volumes with their usage.
    Ls,
    /// Show one volume and the sandboxes that have it mounted.
    Info {
        /// Volume name.
        name: String,
    },
    /// Delete volumes and their data (refused while a sandbox has one mounted).
    Rm {
        /// Volume names.
        #[arg(required = true)]
        names: Vec<String>,
    },
}

/// Parses `NAME:/PATH`, `NAME:/PATH:ro` or `NAME:/PATH:rw`.
pub fn parse_volume(s: &str) -> Result<VolumeMountSpec, String> {
    let bad = || format!("expected NAME:/PATH[:ro], got {s:?}");
    let (name, rest) = s.split_once(':').ok_or_else(bad)?;
    let (path, read_only) = match rest.rsplit_once(':') {
        Some((p, "ro")) => (p, true),
        Some((p, "rw")) => (p, false),
        _ => (rest, false),
    };
    if name.is_empty() || !path.starts_with('/') {
        return Err(bad());
    }
    Ok(VolumeMountSpec {
        name: name.to_string(),
        path: path.to_string(),
        read_only,
    })
}

/// Runs one `volume` subcommand; the result is the exit code.
pub async fn run(ctx: &Ctx, cmd: VolumeCommand) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    match cmd {
        VolumeCommand::Create { name, size } => {
            let v = client.create_volume(&name, size).await?;
            if ctx.json {
                print_json(&v)?;
            } else {
                show(std::slice::from_ref(&v));
            }
        }
        VolumeCommand::Ls => {
            let vs = client.list_volumes().await?;
            if ctx.json {
                print_json(&vs)?;
            } else {
                show(&vs);
            }
        }
        VolumeCommand::Info { name } => {
            let v = client.get_volume(&name).await?;
            if ctx.json {
                print_json(&v)?;
            } else {
                show(std::slice::from_ref(&v));
            }
        }
        VolumeCommand::Rm { names } => {
            let mut failed = 0u8;
            for name in names {
                match client.delete_volume(&name).await {
                    Ok(()) if !ctx.json => println!("deleted volume {name}"),
                    Ok(()) => {}
                    Err(e) => {
                        eprintln!("error: {name}: {e}");
                        failed = 1;
                    }
                }
            }
            return Ok(failed);
        }
    }
    Ok(0)
}

fn show(vs: &[Volume]) {
    let opt = |b: Option<u64>| b.map(human_bytes).unwrap_or_else(|| "-".into());
    let rows: Vec<Vec<String>> = vs
        .iter()
        .map(|v| {
            vec![
                v.name.clone(),
                human_bytes(v.size_bytes),
                opt(v.used_bytes),
                opt(v.available_bytes),
                v.state.clone(),
                time_since(v.created_at_ms),
                if v.in_use_by.is_empty() {
                    "-".into()
                } else {
                    v.in_use_by.join(",")
                },
            ]
        })
        .collect();
    print_table(
        &[
            "NAME",
            "SIZE",
            "USED",
            "AVAIL",
            "STATE",
            "CREATED",
            "MOUNTED BY",
        ],
        &rows,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_options() {
        let v = parse_volume("data:/workspace/data").unwrap();
        assert_eq!(
            (v.name.as_str(), v.path.as_str(), v.read_only),
            ("data", "/workspace/data", false)
        );
        let v = parse_volume("data:/srv:ro").unwrap();
        assert_eq!((v.path.as_str(), v.read_only), ("/srv", true));
        let v = parse_volume("data:/srv:rw").unwrap();
        assert_eq!((v.path.as_str(), v.read_only), ("/srv", false));
        // A colon inside the path stays in it.
        let v = parse_volume("d:/a:b").unwrap();
        assert_eq!((v.path.as_str(), v.read_only), ("/a:b", false));
        for bad in ["data", ":/x", "data:x", "data:", "data:ro"] {
            assert!(parse_volume(bad).is_err(), "{bad:?} accepted");
        }
    }
}
