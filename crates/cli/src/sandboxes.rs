//! Sandbox lifecycle subcommands through the daemon's API: create, ls, info, rm, timeout.

use sandpit_api::{CreateSandboxRequest, Sandbox, SandboxList};

use crate::util::{human_bytes, print_fields, print_json, print_table, time_since, time_until};
use crate::{CreateArgs, Ctx, LsArgs, SandboxOpts};

/// The create request for these options.
pub fn create_request(
    opts: &SandboxOpts,
    timeout: Option<u64>,
    env: &[(String, String)],
) -> CreateSandboxRequest {
    CreateSandboxRequest {
        template: opts.template.clone(),
        runtime: opts.runtime.clone(),
        timeout,
        limits: opts.limits.spec(),
        env: env.iter().cloned().collect(),
        metadata: opts.meta.iter().cloned().collect(),
        workdir: opts.workdir.clone(),
        volumes: opts.volumes.clone(),
        ..Default::default()
    }
}

/// `sandpit create`.
pub async fn create(ctx: &Ctx, args: CreateArgs) -> anyhow::Result<()> {
    let client = ctx.client()?;
    let req = CreateSandboxRequest {
        user: args.user.clone(),
        secret_env: args.secret_env.clone(),
        snapshot: args.snapshot.clone(),
        idle_timeout: args.idle_timeout,
        on_timeout: args.on_timeout.clone(),
        auto_resume: args.no_auto_resume.then_some(false),
        ..create_request(&args.sandbox, args.timeout, &args.env)
    };
    let sandbox = client.create_sandbox(&req).await?;
    if ctx.json {
        print_json(&sandbox)
    } else {
        println!("{}", sandbox.id);
        Ok(())
    }
}

/// `sandpit ls`.
pub async fn list(ctx: &Ctx, args: LsArgs) -> anyhow::Result<()> {
    let client = ctx.client()?;
    let mut items = Vec::new();
    let mut cursor = args.cursor.clone();
    let next_cursor = loop {
        let page = client
            .list_sandboxes(
                args.state.as_deref(),
                &args.meta,
                args.limit,
                cursor.as_deref(),
            )
            .await?;
        items.extend(page.items);
        match page.next_cursor {
            Some(next) if args.all => cursor = Some(next),
            next => break next,
        }
    };
    if ctx.json {
        return print_json(&SandboxList { items, next_cursor });
    }
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|s| {
            let expires = if matches!(s.state.as_str(), "stopped" | "error") {
                "-".to_string()
            } else {
                time_until(s.expires_at_ms)
            };
            vec![
                s.id.clone(),
                s.state.clone(),
                s.runtime.clone(),
                s.template.clone(),
                expires,
            ]
        })
        .collect();
    print_table(&["ID", "STATE", "RUNTIME", "TEMPLATE", "EXPIRES IN"], &rows);
    if let Some(next) = next_cursor {
        eprintln!("more: sandpit ls --cursor {next} (or --all)");
    }
    Ok(())
}

/// `sandpit info [ID]`.
pub async fn info(ctx: &Ctx, id: Option<&str>) -> anyhow::Result<()> {
    let client = ctx.client()?;
    let Some(id) = id else {
        let info = client.info().await?;
        if ctx.json {
            return print_json(&info);
        }
        println!("VERSION          {}", info.version);
        println!("DEFAULT RUNTIME  {}", info.default_runtime);
        println!("MAX TIMEOUT      {}s", info.max_timeout);
        let rows: Vec<Vec<String>> = info
            .runtimes
            .iter()
            .map(|r| {
                let yes = |b: bool| if b { "yes" } else { "no" }.to_string();
                vec![
                    r.name.clone(),
                    yes(r.isolated),
                    yes(r.freeze),
                    yes(r.stats),
                    yes(r.enforces_memory),
                    yes(r.enforces_disk),
                    yes(r.enforces_processes),
                ]
            })
            .collect();
        println!();
        print_table(
            &[
                "RUNTIME",
                "ISOLATED",
                "PAUSE",
                "STATS",
                "MEMORY LIMIT",
                "DISK LIMIT",
                "PROCESS LIMIT",
            ],
            &rows,
        );
        return Ok(());
    };
    let sandbox = client.get_sandbox(id).await?;
    if ctx.json {
        return print_json(&sandbox);
    }
    print_sandbox(&sandbox);
    if sandbox.state == "running"
        && let Ok(stats) = client.stats(id).await
    {
        println!(
            "USAGE     cpu {:.2}s, memory {} (peak {}), {} processes",
            stats.cpu_usage_ns as f64 / 1e9,
            human_bytes(stats.memory_current_bytes),
            human_bytes(stats.memory_peak_bytes),
            stats.pids_current
        );
    }
    Ok(())
}

fn print_sandbox(s: &Sandbox) {
    let isolation = if s.isolated {
        "isolated"
    } else {
        "NOT isolated"
    };
    let mut rows = vec![
        ("ID", s.id.clone()),
        ("STATE", s.state.clone()),
        ("RUNTIME", format!("{} ({isolation})", s.runtime)),
        ("TEMPLATE", s.template.clone()),
        ("CREATED", time_since(s.created_at_ms)),
    ];
    if !matches!(s.state.as_str(), "stopped" | "error") {
        rows.push(("EXPIRES", format!("in {}", time_until(s.expires_at_ms))));
    }
    let l = &s.limits;
    rows.push((
        "LIMITS",
        format!(
            "cpu {}m, memory {}, disk {}, {} processes",
            l.cpu_millis,
            human_bytes(l.memory_bytes),
            human_bytes(l.disk_bytes),
            l.max_processes
        ),
    ));
    if !s.metadata.is_empty() {
        let meta: Vec<String> = s.metadata.iter().map(|(k, v)| format!("{k}={v}")).collect();
        rows.push(("METADATA", meta.join(" ")));
    }
    if let Some(err) = &s.error {
        rows.push(("ERROR", err.clone()));
    }
    print_fields(&rows);
}

/// `sandpit rm ID...`: deletes each; failures are reported and make the exit code 1.
pub async fn remove(ctx: &Ctx, ids: &[String]) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let mut deleted = Vec::new();
    let mut failed = false;
    for id in ids {
        match client.delete_sandbox(id).await {
            Ok(()) => {
                if !ctx.json {
                    println!("{id}");
                }
                deleted.push(id.clone());
            }
            Err(e) => {
                eprintln!("error: {id}: {e}");
                failed = true;
            }
        }
    }
    if ctx.json {
        print_json(&serde_json::json!({ "deleted": deleted }))?;
    }
    Ok(u8::from(failed))
}

/// `sandpit timeout ID SECS`.
pub async fn set_timeout(ctx: &Ctx, id: &str, secs: u64) -> anyhow::Result<()> {
    ctx.client()?.set_timeout(id, secs).await?;
    Ok(())
}
