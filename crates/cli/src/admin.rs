//! Local administration on the daemon's database: API keys and template registration.
//! These work without the daemon (and without an API key): access to the data dir is the
//! authority.

use std::path::Path;

use anyhow::Context;
use sandpit_store::{Store, TemplateRecord};

use crate::util::{now_ms, print_json, print_table, time_since};
use crate::{Ctx, KeysCommand};

/// File name of the database inside the data dir.
const DB_FILE: &str = "sandpit.db";

/// Opens the store; `create` makes the data dir and database when they are missing.
async fn open_store(ctx: &Ctx, create: bool) -> anyhow::Result<Store> {
    let path = ctx.data_dir.join(DB_FILE);
    if !path.exists() {
        if !create {
            anyhow::bail!(
                "no database at {} (start the daemon once with `sandpit serve`, or pass --data-dir)",
                path.display()
            );
        }
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&ctx.data_dir)
            .with_context(|| format!("cannot create {}", ctx.data_dir.display()))?;
    }
    Store::open(&path)
        .await
        .with_context(|| format!("cannot open {}", path.display()))
}

/// `sandpit keys ...`.
pub async fn keys(ctx: &Ctx, cmd: KeysCommand) -> anyhow::Result<()> {
    match cmd {
        KeysCommand::Create { owner, name, roles } => {
            if owner.trim().is_empty() {
                anyhow::bail!("--owner must not be empty");
            }
            if let Some(bad) = roles.iter().find(|r| r.as_str() != "approver") {
                anyhow::bail!("unknown role {bad:?} (known: approver)");
            }
            let store = open_store(ctx, true).await?;
            let (key, secret) = store.create_api_key(&owner, &name).await?;
            for role in &roles {
                store.add_api_key_role(&key.id, role).await?;
            }
            store.close().await;
            if ctx.json {
                print_json(&serde_json::json!({
                    "id": key.id,
                    "owner": key.owner,
                    "name": key.name,
                    "created_at_ms": key.created_at_ms,
                    "roles": roles,
                    "key": secret,
                    "e2b_key": sandpit_store::e2b_key_form(&secret),
                }))
            } else {
                println!("{secret}");
                eprintln!(
                    "key {} for owner {:?}: store it now, it cannot be shown again",
                    key.id, key.owner
                );
                if let Some(e2b) = sandpit_store::e2b_key_form(&secret) {
                    eprintln!("for E2B's SDKs (E2B_API_KEY) the same key reads {e2b}");
                }
                Ok(())
            }
        }
        KeysCommand::Ls => {
            let store = open_store(ctx, false).await?;
            let keys = store.list_api_keys().await?;
            store.close().await;
            if ctx.json {
                return print_json(&keys);
            }
            let rows: Vec<Vec<String>> = keys
                .iter()
                .map(|k| {
                    let used = k
                        .last_used_at_ms
                        .map_or_else(|| "never".to_string(), time_since);
                    vec![
                        k.id.clone(),
                        k.owner.clone(),
                        k.name.clone(),
                        time_since(k.created_at_ms),
                        used,
                    ]
                })
                .collect();
            print_table(&["ID", "OWNER", "NAME", "CREATED", "LAST USED"], &rows);
            Ok(())
        }
        KeysCommand::Revoke { id } => {
            let store = open_store(ctx, false).await?;
            let revoked = store.revoke_api_key(&id).await?;
            store.close().await;
            if !revoked {
                anyhow::bail!("no API key with id {id}");
            }
            if ctx.json {
                print_json(&serde_json::json!({ "revoked": id }))?;
            }
            Ok(())
        }
    }
}

/// Template names are short identifiers; `host` is built in.
fn check_template_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !name.starts_with('.');
    if !ok {
        anyhow::bail!("bad template name {name:?}: use up to 64 letters, digits, '-', '_' or '.'");
    }
    if name == "host" {
        anyhow::bail!("`host` is the built-in template and cannot be replaced");
    }
    Ok(())
}

/// `sandpit template add NAME --rootfs DIR`.
pub async fn template_add(ctx: &Ctx, name: &str, rootfs: &Path) -> anyhow::Result<()> {
    check_template_name(name)?;
    let dir = std::fs::canonicalize(rootfs)
        .with_context(|| format!("cannot find {}", rootfs.display()))?;
    if !dir.is_dir() {
        anyhow::bail!("{} is not a directory", dir.display());
    }
    if !dir.join("usr/bin").is_dir() && !dir.join("bin").is_dir() {
        anyhow::bail!(
            "{} does not look like a root filesystem (no usr/bin or bin)",
            dir.display()
        );
    }
    let rootfs = dir
        .to_str()
        .with_context(|| format!("{} is not valid UTF-8", dir.display()))?
        .to_string();
    let store = open_store(ctx, true).await?;
    // A built template owns its directory; repointing it would orphan that.
    if let Some(existing) = store.get_template(name).await?
        && !existing.source.is_null()
    {
        store.close().await;
        anyhow::bail!(
            "template {name} was built by the daemon; remove it first (`sandpit template rm {name}`)"
        );
    }
    let record = TemplateRecord {
        name: name.to_string(),
        rootfs,
        created_at_ms: now_ms(),
        updated_at_ms: now_ms(),
        ..Default::default()
    };
    store.upsert_template(&record).await?;
    store.close().await;
    if ctx.json {
        print_json(&record)
    } else {
        println!("{name}");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_names() {
        assert!(check_template_name("ubuntu-24.04").is_ok());
        assert!(check_template_name("host").is_err());
        assert!(check_template_name("").is_err());
        assert!(check_template_name("a/b").is_err());
        assert!(check_template_name("..").is_err());
    }
}
