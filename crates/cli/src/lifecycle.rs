//! `sandpit pause|resume|fork|snapshot ...`.

use crate::util::{human_bytes, print_json, print_table, time_since};
use crate::{Ctx, SnapshotCommand};
use sandpit_api::{CreateSnapshotRequest, ForkRequest, Snapshot};

/// `sandpit pause [--hibernate]`.
pub async fn pause(ctx: &Ctx, id: &str, hibernate: bool) -> anyhow::Result<()> {
    let client = ctx.client()?;
    let sb = if hibernate {
        client.hibernate(id).await?
    } else {
        client.pause(id).await?
    };
    if ctx.json {
        print_json(&sb)
    } else {
        println!("{} {}", sb.id, sb.state);
        Ok(())
    }
}

/// `sandpit resume`.
pub async fn resume(ctx: &Ctx, id: &str) -> anyhow::Result<()> {
    let sb = ctx.client()?.resume(id).await?;
    if ctx.json {
        print_json(&sb)
    } else {
        println!("{} {}", sb.id, sb.state);
        Ok(())
    }
}

/// `sandpit fork`.
pub async fn fork(ctx: &Ctx, id: &str, count: u32) -> anyhow::Result<()> {
    let req = ForkRequest {
        count: Some(count),
        ..Default::default()
    };
    let made = ctx.client()?.fork(id, &req).await?;
    if ctx.json {
        return print_json(&made);
    }
    for sb in made {
        println!("{}", sb.id);
    }
    Ok(())
}

/// `sandpit snapshot ...`.
pub async fn snapshot(ctx: &Ctx, cmd: SnapshotCommand) -> anyhow::Result<()> {
    let client = ctx.client()?;
    match cmd {
        SnapshotCommand::Create {
            id,
            name,
            incremental,
        } => {
            let snap = client
                .snapshot(&id, &CreateSnapshotRequest { name, incremental })
                .await?;
            if ctx.json {
                print_json(&snap)
            } else {
                println!("{}", snap.id);
                Ok(())
            }
        }
        SnapshotCommand::Ls => {
            let list = client.list_snapshots().await?;
            if ctx.json {
                return print_json(&list);
            }
            let rows: Vec<Vec<String>> = list.items.iter().map(row).collect();
            print_table(
                &["ID", "NAME", "SANDBOX", "KIND", "PARENT", "SIZE", "CREATED"],
                &rows,
            );
            Ok(())
        }
        SnapshotCommand::Info { id } => {
            let snap = client.get_snapshot(&id).await?;
            if ctx.json {
                return print_json(&snap);
            }
            print_table(
                &["ID", "NAME", "SANDBOX", "KIND", "PARENT", "SIZE", "CREATED"],
                &[row(&snap)],
            );
            println!(
                "template {}, runtime {}, {} entries",
                snap.template, snap.runtime, snap.entries
            );
            println!("sha256 {}", snap.digest);
            Ok(())
        }
        SnapshotCommand::Verify { id } => {
            let check = client.verify_snapshot(&id).await?;
            if ctx.json {
                print_json(&check)?;
            } else {
                for item in &check.chain {
                    let verdict = if item.ok { "ok" } else { "BAD" };
                    let detail = item.error.clone().unwrap_or_default();
                    println!("{} {verdict} {detail}", item.id);
                }
            }
            if !check.ok {
                anyhow::bail!("snapshot {id} failed its integrity check");
            }
            Ok(())
        }
        SnapshotCommand::Rm { id, force } => {
            client.delete_snapshot(&id, force).await?;
            Ok(())
        }
    }
}

fn row(s: &Snapshot) -> Vec<String> {
    vec![
        s.id.clone(),
        s.name.clone(),
        s.sandbox_id.clone(),
        s.kind.clone(),
        s.parent.clone().unwrap_or_else(|| "-".into()),
        human_bytes(s.size_bytes),
        time_since(s.created_at_ms),
    ]
}
