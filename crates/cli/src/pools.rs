//! `sandpit pool`: warm pools through the daemon's API.

use sandpit_api::{Pool, PoolSpec};

use crate::util::{human_bytes, print_json, print_table};
use crate::{Ctx, PoolCommand};

/// Runs one `pool` subcommand.
pub async fn run(ctx: &Ctx, cmd: PoolCommand) -> anyhow::Result<()> {
    let client = ctx.client()?;
    match cmd {
        PoolCommand::Ls => {
            let pools = client.list_pools().await?;
            if ctx.json {
                return print_json(&pools);
            }
            show(&pools);
            Ok(())
        }
        PoolCommand::Info { name } => {
            let pool = client.get_pool(&name).await?;
            if ctx.json {
                return print_json(&pool);
            }
            show(std::slice::from_ref(&pool));
            Ok(())
        }
        PoolCommand::Create {
            name,
            size,
            template,
            runtime,
            limits,
        } => {
            let spec = PoolSpec {
                name,
                template,
                runtime,
                limits: limits.spec(),
                size,
            };
            let pool = client.create_pool(&spec).await?;
            if ctx.json {
                return print_json(&pool);
            }
            show(std::slice::from_ref(&pool));
            Ok(())
        }
        PoolCommand::Resize { name, size } => {
            let pool = client.resize_pool(&name, size).await?;
            if ctx.json {
                return print_json(&pool);
            }
            show(std::slice::from_ref(&pool));
            Ok(())
        }
        PoolCommand::Rm { name } => {
            client.delete_pool(&name).await?;
            if !ctx.json {
                println!("deleted pool {name}");
            }
            Ok(())
        }
    }
}

fn show(pools: &[Pool]) {
    let rows: Vec<Vec<String>> = pools
        .iter()
        .map(|p| {
            vec![
                p.name.clone(),
                format!("{}/{}", p.ready, p.size),
                p.starting.to_string(),
                p.hits.to_string(),
                p.misses.to_string(),
                p.template.clone(),
                p.runtime.clone(),
                format!(
                    "{}m cpu, {} mem, {} disk, {} procs",
                    p.limits.cpu_millis,
                    human_bytes(p.limits.memory_bytes),
                    human_bytes(p.limits.disk_bytes),
                    p.limits.max_processes
                ),
                p.source.clone(),
            ]
        })
        .collect();
    print_table(
        &[
            "NAME", "READY", "STARTING", "HITS", "MISSES", "TEMPLATE", "RUNTIME", "LIMITS",
            "SOURCE",
        ],
        &rows,
    );
}
