//! `sandpit cp`: files between a sandbox and this machine, streamed both ways.

use std::path::{Path, PathBuf};

use std::io::Write;

use anyhow::Context;
use futures::StreamExt;
use sandpit_client::{Body, Client};

use crate::Ctx;

/// One side of a copy.
#[derive(Debug, PartialEq, Eq)]
enum Location {
    /// `-`: stdin as a source, stdout as a destination.
    Stdio,
    Local(PathBuf),
    Remote {
        id: String,
        path: String,
    },
}

impl Location {
    /// `ID:PATH` is remote when ID looks like a sandbox id; `-` is stdio; the rest is local
    /// (write `./a:b` for a local file with a colon in its name).
    fn parse(arg: &str) -> Location {
        if arg == "-" {
            return Location::Stdio;
        }
        if let Some((id, path)) = arg.split_once(':') {
            let id_like = !id.is_empty()
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if id_like && !path.is_empty() {
                return Location::Remote {
                    id: id.to_string(),
                    path: path.to_string(),
                };
            }
        }
        Location::Local(PathBuf::from(arg))
    }
}

/// Last component of a sandbox path (`/a/b/` → `b`).
fn remote_basename(path: &str) -> Option<&str> {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|s| !s.is_empty())
}

/// `sandpit cp SRC DST`.
pub async fn copy(ctx: &Ctx, src: &str, dst: &str) -> anyhow::Result<()> {
    match (Location::parse(src), Location::parse(dst)) {
        (Location::Remote { id, path }, Location::Stdio) => {
            let client = ctx.client()?;
            let mut chunks = std::pin::pin!(client.download_stream(&id, &path).await?);
            let mut stdout = std::io::stdout().lock();
            while let Some(chunk) = chunks.next().await {
                stdout.write_all(&chunk?)?;
            }
            stdout.flush()?;
            Ok(())
        }
        (Location::Remote { id, path }, Location::Local(local)) => {
            let client = ctx.client()?;
            download(&client, &id, &path, &local).await
        }
        (Location::Stdio, Location::Remote { id, path }) => {
            if path.ends_with('/') {
                anyhow::bail!("{path} names a directory; give a file name to write stdin to");
            }
            let client = ctx.client()?;
            let rx = crate::exec::spawn_stdin_reader()?;
            let chunks = futures::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|chunk| (chunk, rx))
            });
            client
                .write_file(&id, &path, Body::wrap_stream(chunks))
                .await?;
            Ok(())
        }
        (Location::Local(local), Location::Remote { id, path }) => {
            let client = ctx.client()?;
            upload(&client, &local, &id, &path).await
        }
        (Location::Remote { id: a, path: from }, Location::Remote { id: b, path: to }) => {
            if a != b {
                anyhow::bail!(
                    "copying between two sandboxes is not supported; go through a local file"
                );
            }
            ctx.client()?.copy_path(&a, &from, &to).await?;
            Ok(())
        }
        _ => anyhow::bail!(
            "one side must be in a sandbox (ID:/path) and the other here (a path, or -)"
        ),
    }
}

async fn download(client: &Client, id: &str, path: &str, local: &Path) -> anyhow::Result<()> {
    let target = if local.is_dir() {
        let name = remote_basename(path).with_context(|| format!("{path} has no file name"))?;
        local.join(name)
    } else {
        local.to_path_buf()
    };
    let mut file = tokio::fs::File::create(&target)
        .await
        .with_context(|| format!("cannot create {}", target.display()))?;
    if let Err(e) = client.download_to(id, path, &mut file).await {
        drop(file);
        // A partial file would look like a good copy.
        let _ = tokio::fs::remove_file(&target).await;
        return Err(e.into());
    }
    file.sync_all()
        .await
        .with_context(|| format!("cannot write {}", target.display()))?;
    Ok(())
}

async fn upload(client: &Client, local: &Path, id: &str, path: &str) -> anyhow::Result<()> {
    let meta = tokio::fs::metadata(local)
        .await
        .with_context(|| format!("cannot read {}", local.display()))?;
    if meta.is_dir() {
        anyhow::bail!("{} is a directory; cp copies single files", local.display());
    }
    let name = local.file_name().map(|n| n.to_string_lossy().into_owned());
    // Into a directory: keep the local file's name, as cp(1) does.
    let into_dir =
        path.ends_with('/') || client.stat(id, path).await.is_ok_and(|e| e.r#type == "dir");
    let target = match (into_dir, name) {
        (true, Some(name)) => format!("{}/{name}", path.trim_end_matches('/')),
        (true, None) => anyhow::bail!("{} has no file name", local.display()),
        (false, _) => path.to_string(),
    };
    client
        .upload_from_file(id, &target, local)
        .await
        .with_context(|| format!("cannot upload {} to {id}:{target}", local.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations() {
        assert_eq!(Location::parse("-"), Location::Stdio);
        assert_eq!(
            Location::parse("sb_1-x:/tmp/a:b"),
            Location::Remote {
                id: "sb_1-x".into(),
                path: "/tmp/a:b".into()
            }
        );
        assert_eq!(Location::parse("./a:b"), Location::Local("./a:b".into()));
        assert_eq!(
            Location::parse("/abs/path"),
            Location::Local("/abs/path".into())
        );
        assert_eq!(Location::parse("id:"), Location::Local("id:".into()));
    }

    #[test]
    fn basenames() {
        assert_eq!(remote_basename("/a/b"), Some("b"));
        assert_eq!(remote_basename("/a/b/"), Some("b"));
        assert_eq!(remote_basename("/"), None);
    }
}
