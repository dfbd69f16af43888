//! The build pipeline of a template: a work directory marked as sandpit's, the source
//! (host directory, OCI image, debootstrap, snapshot) laid down as a root filesystem, the
//! image's config applied, and the record finished; every step logged to the build.

use super::*;

pub(crate) async fn rec_state_now(store: &Store, name: &str) -> Option<TemplateState> {
    store
        .get_template(name)
        .await
        .ok()
        .flatten()
        .map(|r| r.state)
}

/// Makes the build's own directory (private to the daemon: a template may hold setuid
/// files) with its marker.
pub(crate) fn prepare_work_dir(
    templates: &Path,
    work: &Path,
    rec: &TemplateRecord,
) -> Result<(), BuildError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(templates)
        .map_err(|e| BuildError::io("create", templates, e))?;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(work)
        .map_err(|e| BuildError::io("create", work, e))?;
    let marker = serde_json::json!({ "name": rec.name, "build_id": rec.build_id });
    std::fs::write(work.join(MARKER), marker.to_string())
        .map_err(|e| BuildError::io("write", &work.join(MARKER), e))
}

/// The build itself, in the background: makes the root filesystem, then records the
/// outcome. A failure removes the build's directory.
pub(crate) async fn run_build(
    store: Store,
    build: Arc<Build>,
    mut rec: TemplateRecord,
    source: Source,
    work: PathBuf,
) {
    let rootfs = work.join("rootfs");
    let made = match &source {
        Source::Dir(src) => {
            build.push(format!("copying {}", src.display()));
            let (b, src, dst) = (build.clone(), src.clone(), rootfs.clone());
            tokio::task::spawn_blocking(move || {
                let cancelled = || b.cancel.is_cancelled();
                copy::copy_tree(&src, &dst, &mut |line| b.push(line), &cancelled).map(|_| None)
            })
            .await
            .unwrap_or_else(|e| Err(BuildError::Failed(format!("copy task: {e}"))))
        }
        Source::Debootstrap {
            suite,
            packages,
            mirror,
        } => debootstrap::run(&build, suite, packages, mirror.as_deref(), &rootfs)
            .await
            .map(|()| None),
        Source::Layers { from, base } => {
            build.push(format!(
                "copying {} snapshot layer(s) over template {base}",
                from.len()
            ));
            let (b, from, dst) = (build.clone(), from.clone(), rootfs.clone());
            let copied = tokio::task::spawn_blocking(move || {
                std::fs::create_dir_all(&dst).map_err(|e| BuildError::io("create", &dst, e))?;
                for (i, dir) in from.iter().enumerate() {
                    if b.cancel.is_cancelled() {
                        return Err(BuildError::Cancelled);
                    }
                    let layer = sandpit_image::Layer {
                        dir: dir.clone(),
                        id_base: 0,
                    };
                    let stats =
                        sandpit_image::copy_layer(&layer, &dst.join(format!("{i:03}")), &[])
                            .map_err(|e| BuildError::Failed(format!("copy layer {i}: {e}")))?;
                    b.push(format!(
                        "layer {}: {} entries, {}",
                        i + 1,
                        stats.entries,
                        copy::human(stats.bytes)
                    ));
                }
                Ok(copy::tree_size(&dst))
            })
            .await
            .unwrap_or_else(|e| Err(BuildError::Failed(format!("copy task: {e}"))));
            // Layers are no root filesystem: nothing of `finish_rootfs` applies.
            return finish_build(store, build, rec, copied, work).await;
        }
        Source::Oci(src) => {
            build.push(format!("importing the image {}", src.display()));
            let (b, src, dst) = (build.clone(), src.clone(), rootfs.clone());
            tokio::task::spawn_blocking(move || {
                sandpit_image::import_image(&src, &dst, &mut |p| {
                    b.push(format!(
                        "applied layer {}/{} ({})",
                        p.index,
                        p.total,
                        copy::human(p.bytes)
                    ))
                })
                .map(Some)
                .map_err(|e| BuildError::Failed(format!("image import: {e}")))
            })
            .await
            .unwrap_or_else(|e| Err(BuildError::Failed(format!("import task: {e}"))))
        }
    };
    // An import cannot stop half-way; a removal asked for meanwhile takes effect here.
    let made = match made {
        Ok(_) if build.cancel.is_cancelled() => Err(BuildError::Cancelled),
        other => other,
    };
    let made = match made {
        Ok(image) => {
            if let Some(config) = image {
                apply_image_config(&build, &mut rec, config, &rootfs);
            }
            let (b, r, settings) = (build.clone(), rootfs.clone(), rec.clone());
            tokio::task::spawn_blocking(move || finish_rootfs(&b, &r, &settings))
                .await
                .unwrap_or_else(|e| Err(BuildError::Failed(format!("finishing task: {e}"))))
        }
        Err(e) => Err(e),
    };
    finish_build(store, build, rec, made, work).await;
}

/// Records a build's outcome: ready with its size, or failed (its directory removed).
pub(crate) async fn finish_build(
    store: Store,
    build: Arc<Build>,
    mut rec: TemplateRecord,
    made: Result<u64, BuildError>,
    work: PathBuf,
) {
    match made {
        Ok(size) => {
            rec.state = TemplateState::Ready;
            rec.size_bytes = i64::try_from(size).unwrap_or(i64::MAX);
            match store.finish_template_build(&rec).await {
                Ok(true) => {
                    build.push(format!(
                        "template {} is ready ({})",
                        rec.name,
                        copy::human(size)
                    ));
                    build.finish(TemplateState::Ready, None);
                    tracing::info!(template = %rec.name, size, "template built");
                }
                Ok(false) => {
                    let _ = remove::remove_tree(&work);
                    build.finish(
                        TemplateState::Failed,
                        Some("the template was removed during its build".into()),
                    );
                }
                Err(e) => {
                    let _ = remove::remove_tree(&work);
                    let msg = format!("recording the build failed: {e}");
                    build.push(format!("error: {msg}"));
                    build.finish(TemplateState::Failed, Some(msg));
                }
            }
        }
        Err(e) => {
            let mut msg = e.to_string();
            build.push(format!("error: {msg}"));
            if let Err(re) = {
                let w = work.clone();
                tokio::task::spawn_blocking(move || remove::remove_tree(&w))
                    .await
                    .unwrap_or_else(|e| Err(BuildError::Failed(e.to_string())))
            } {
                tracing::error!(dir = %work.display(), error = %re, "removing a failed build failed");
                msg.push_str(&format!(" (its directory could not be removed: {re})"));
            }
            tracing::warn!(template = %rec.name, error = %msg, "template build failed");
            rec.state = TemplateState::Failed;
            rec.error = Some(msg.clone());
            if let Err(se) = store.finish_template_build(&rec).await {
                tracing::warn!(template = %rec.name, error = %se, "recording a failed build failed");
            }
            build.finish(TemplateState::Failed, Some(msg));
        }
    }
}

/// Quotes one argument for `/bin/sh`.
pub(crate) fn shell_quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_@%+=:,./-".contains(&b));
    if plain {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', "'\\''"))
    }
}

/// The sandbox account an image's `user` (`name`, `uid`, `name:group`...) runs as:
/// an image without one, or with root's, runs as `root`; any other as `user`.
pub(crate) fn account_of_image_user(user: Option<&str>) -> &'static str {
    let name = user.unwrap_or("").split(':').next().unwrap_or("").trim();
    if name.is_empty() || name == "root" || name == "0" {
        "root"
    } else {
        "user"
    }
}

/// Fills what the build request left out from the image's config: its env (under the
/// request's), user, workdir, and entrypoint + cmd as the start command. Values a sandbox
/// could not take are left out, with a line in the log.
pub(crate) fn apply_image_config(
    build: &Build,
    rec: &mut TemplateRecord,
    config: sandpit_image::ImageConfig,
    rootfs: &Path,
) {
    let mut env = BTreeMap::new();
    for kv in &config.env {
        match kv.split_once('=') {
            Some((k, v))
                if crate::manager::check_env(&[(k.to_string(), v.to_string())].into()).is_ok() =>
            {
                env.insert(k.to_string(), v.to_string());
            }
            _ => build.push(format!("warning: the image's env entry {kv:?} is not used")),
        }
    }
    env.extend(std::mem::take(&mut rec.env));
    rec.env = env;
    if rec.default_user.is_none() {
        let account = account_of_image_user(config.user.as_deref());
        if let Some(u) = config.user.as_deref().filter(|u| !u.is_empty()) {
            build.push(format!("the image's user {u:?} runs as `{account}`"));
        }
        rec.default_user = Some(account.to_string());
    }
    if rec.workdir.is_none()
        && let Some(w) = config.workdir.as_deref().filter(|w| !w.is_empty())
    {
        if w.starts_with('/') && !w.contains('\0') && !w.split('/').any(|c| c == "..") {
            rec.workdir = Some(w.to_string());
        } else {
            build.push(format!("warning: the image's workdir {w:?} is not used"));
        }
    }
    let argv: Vec<&String> = config.entrypoint.iter().chain(&config.cmd).collect();
    if rec.start_cmd.is_none() && !argv.is_empty() {
        if std::fs::symlink_metadata(rootfs.join("bin/sh")).is_ok() {
            let line: Vec<String> = argv.iter().map(|a| shell_quote(a)).collect();
            rec.start_cmd = Some(format!("exec {}", line.join(" ")));
        } else {
            build.push(
                "warning: the image's entrypoint and cmd are not used as the start command: the image has no /bin/sh",
            );
        }
    }
}

/// Checks the result is a root filesystem, makes the template's workdir, and measures it.
pub(crate) fn finish_rootfs(
    build: &Build,
    rootfs: &Path,
    rec: &TemplateRecord,
) -> Result<u64, BuildError> {
    sandpit_runtime::template::check_rootfs(rootfs)
        .map_err(|e| BuildError::Failed(e.to_string()))?;
    if let Some(w) = &rec.workdir {
        let id = if rec.default_user.as_deref() == Some("root") {
            0
        } else {
            1000
        };
        if !copy::ensure_dir(rootfs, w, id, id)? {
            build.push(format!(
                "warning: workdir {w} was not created: a part of it is a symlink or a file in the root filesystem"
            ));
        }
    }
    build.push("measuring the root filesystem");
    Ok(copy::tree_size(rootfs))
}
