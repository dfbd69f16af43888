//! Embedded, versioned schema. Each migration runs once, inside the same transaction that
//! records its version, so a crash mid-way leaves the previous version intact.

use sqlx::SqlitePool;

use crate::StoreError;

/// Ordered migrations: (version, statements). Statements are kept one per entry because
/// PostgreSQL cannot prepare several statements at once, and plain DDL so they port.
pub(crate) const MIGRATIONS: &[(i64, &[&str])] = &[
    (
        1,
        &[
            "CREATE TABLE api_keys (
            id TEXT PRIMARY KEY NOT NULL,
            owner TEXT NOT NULL,
            name TEXT NOT NULL,
            key_hash TEXT NOT NULL UNIQUE,
            created_at_ms BIGINT NOT NULL,
            last_used_at_ms BIGINT
        )",
            "CREATE TABLE sandboxes (
            id TEXT PRIMARY KEY NOT NULL,
            owner TEXT NOT NULL,
            template TEXT NOT NULL,
            runtime TEXT NOT NULL,
            state TEXT NOT NULL,
            cpu_millis BIGINT NOT NULL,
            memory_bytes BIGINT NOT NULL,
            disk_bytes BIGINT NOT NULL,
            max_processes BIGINT NOT NULL,
            env TEXT NOT NULL,
            metadata TEXT NOT NULL,
            created_at_ms BIGINT NOT NULL,
            updated_at_ms BIGINT NOT NULL,
            expires_at_ms BIGINT NOT NULL,
            runtime_state TEXT NOT NULL,
            error TEXT,
            version BIGINT NOT NULL
        )",
            // Listing pages by (created_at_ms, id), optionally per owner.
            "CREATE INDEX sandboxes_created_idx ON sandboxes (created_at_ms, id)",
            "CREATE INDEX sandboxes_owner_created_idx ON sandboxes (owner, created_at_ms, id)",
            // The reaper and restart reconciliation select by state.
            "CREATE INDEX sandboxes_state_expires_idx ON sandboxes (state, expires_at_ms)",
            "CREATE TABLE templates (
            name TEXT PRIMARY KEY NOT NULL,
            rootfs TEXT NOT NULL,
            created_at_ms BIGINT NOT NULL
        )",
        ],
    ),
    (
        2,
        &[
            // The warm pool a sandbox belongs to (owner '') or was claimed from.
            "ALTER TABLE sandboxes ADD COLUMN pool TEXT",
            "CREATE INDEX sandboxes_pool_idx ON sandboxes (pool, owner)",
            "CREATE TABLE pools (
            name TEXT PRIMARY KEY NOT NULL,
            template TEXT NOT NULL,
            runtime TEXT NOT NULL,
            cpu_millis BIGINT NOT NULL,
            memory_bytes BIGINT NOT NULL,
            disk_bytes BIGINT NOT NULL,
            max_processes BIGINT NOT NULL,
            size BIGINT NOT NULL,
            source TEXT NOT NULL,
            hits BIGINT NOT NULL,
            misses BIGINT NOT NULL,
            created_at_ms BIGINT NOT NULL
        )",
        ],
    ),
    (
        3,
        &[
            // Lifecycle settings and state of a sandbox (idle rules, layers, snapshot
            // lineage), one JSON document: read whole, written whole or by field.
            "ALTER TABLE sandboxes ADD COLUMN life TEXT NOT NULL DEFAULT '{}'",
            "CREATE TABLE snapshots (
            id TEXT PRIMARY KEY NOT NULL,
            owner TEXT NOT NULL,
            name TEXT NOT NULL,
            sandbox_id TEXT NOT NULL,
            parent TEXT,
            template TEXT NOT NULL,
            runtime TEXT NOT NULL,
            kind TEXT NOT NULL,
            size_bytes BIGINT NOT NULL,
            entries BIGINT NOT NULL,
            digest TEXT NOT NULL,
            settings TEXT NOT NULL,
            created_at_ms BIGINT NOT NULL
        )",
            "CREATE UNIQUE INDEX snapshots_owner_name_idx ON snapshots (owner, name)",
            "CREATE INDEX snapshots_parent_idx ON snapshots (parent)",
        ],
    ),
    (
        4,
        &[
            // Named persistent volumes; `id` names the image and mount on the host.
            "CREATE TABLE volumes (
            id TEXT PRIMARY KEY NOT NULL,
            owner TEXT NOT NULL,
            name TEXT NOT NULL,
            size_bytes BIGINT NOT NULL,
            state TEXT NOT NULL,
            created_at_ms BIGINT NOT NULL,
            UNIQUE (owner, name)
        )",
            // Which sandbox mounts which volume where; goes with either record.
            "CREATE TABLE sandbox_volumes (
            sandbox_id TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
            volume_id TEXT NOT NULL REFERENCES volumes (id) ON DELETE CASCADE,
            path TEXT NOT NULL,
            read_only BOOLEAN NOT NULL,
            PRIMARY KEY (sandbox_id, path)
        )",
            "CREATE INDEX sandbox_volumes_volume_idx ON sandbox_volumes (volume_id)",
        ],
    ),
    (
        5,
        &[
            // Per-user leases (the seed's `sb_container`): one warm sandbox per (owner, user).
            // Every change is a compare-and-set on lock_version.
            "CREATE TABLE leases (
            owner TEXT NOT NULL,
            user_name TEXT NOT NULL,
            sandbox_id TEXT,
            status TEXT NOT NULL,
            paused BIGINT NOT NULL,
            runtime TEXT NOT NULL,
            lock_version BIGINT NOT NULL,
            usage_ms BIGINT NOT NULL,
            last_activity_ms BIGINT NOT NULL,
            creating_since_ms BIGINT,
            created_at_ms BIGINT NOT NULL,
            updated_at_ms BIGINT NOT NULL,
            PRIMARY KEY (owner, user_name)
        )",
            // Metering of one sandbox; outlives the sandbox's own record.
            "CREATE TABLE sandbox_usage (
            sandbox_id TEXT PRIMARY KEY NOT NULL,
            owner TEXT NOT NULL,
            state TEXT NOT NULL,
            created_at_ms BIGINT NOT NULL,
            ended_at_ms BIGINT,
            cpu_ns BIGINT NOT NULL,
            cpu_base_ns BIGINT NOT NULL,
            cpu_last_raw_ns BIGINT,
            memory_peak_bytes BIGINT NOT NULL,
            disk_used_bytes BIGINT,
            egress_bytes BIGINT NOT NULL,
            sampled_at_ms BIGINT NOT NULL
        )",
            "CREATE INDEX sandbox_usage_owner_idx ON sandbox_usage (owner, created_at_ms)",
            // Every state change with its time: active time is the time spent running.
            "CREATE TABLE usage_states (
            id INTEGER PRIMARY KEY,
            sandbox_id TEXT NOT NULL,
            state TEXT NOT NULL,
            at_ms BIGINT NOT NULL
        )",
            "CREATE INDEX usage_states_sandbox_idx ON usage_states (sandbox_id, at_ms, id)",
            "CREATE TABLE usage_log (
            id INTEGER PRIMARY KEY,
            sandbox_id TEXT NOT NULL,
            owner TEXT NOT NULL,
            reason TEXT NOT NULL,
            at_ms BIGINT NOT NULL,
            amount BIGINT NOT NULL,
            details TEXT
        )",
            "CREATE INDEX usage_log_owner_idx ON usage_log (owner, at_ms)",
            "CREATE INDEX usage_log_sandbox_idx ON usage_log (sandbox_id, at_ms)",
            "CREATE TABLE executions (
            id TEXT PRIMARY KEY NOT NULL,
            sandbox_id TEXT NOT NULL,
            owner TEXT NOT NULL,
            api_key_id TEXT,
            command TEXT NOT NULL,
            pid BIGINT,
            background BIGINT NOT NULL,
            created_at_ms BIGINT NOT NULL,
            started_at_ms BIGINT,
            ended_at_ms BIGINT,
            cpu_time_ms BIGINT,
            memory_peak_kb BIGINT,
            exit_code BIGINT,
            timed_out BIGINT NOT NULL,
            stdout_bytes BIGINT NOT NULL,
            stderr_bytes BIGINT NOT NULL
        )",
            "CREATE INDEX executions_sandbox_idx ON executions (sandbox_id, created_at_ms, id)",
            "CREATE INDEX executions_owner_idx ON executions (owner, created_at_ms)",
        ],
    ),
    (
        6,
        &[
            // Templates built by the daemon: settings sandboxes start with, where the root
            // filesystem came from, and the state of its build. Rows registered before
            // (`sandpit template add`) are ready, with no settings.
            "ALTER TABLE templates ADD COLUMN default_user TEXT",
            "ALTER TABLE templates ADD COLUMN workdir TEXT",
            "ALTER TABLE templates ADD COLUMN env TEXT NOT NULL DEFAULT '{}'",
            "ALTER TABLE templates ADD COLUMN start_cmd TEXT",
            "ALTER TABLE templates ADD COLUMN ready_cmd TEXT",
            "ALTER TABLE templates ADD COLUMN ready_timeout_secs BIGINT",
            "ALTER TABLE templates ADD COLUMN source TEXT NOT NULL DEFAULT 'null'",
            "ALTER TABLE templates ADD COLUMN size_bytes BIGINT NOT NULL DEFAULT 0",
            "ALTER TABLE templates ADD COLUMN state TEXT NOT NULL DEFAULT 'ready'",
            "ALTER TABLE templates ADD COLUMN error TEXT",
            "ALTER TABLE templates ADD COLUMN updated_at_ms BIGINT NOT NULL DEFAULT 0",
            "ALTER TABLE templates ADD COLUMN build_id TEXT",
            // Deleting a template asks whether any sandbox still uses it.
            "CREATE INDEX sandboxes_template_idx ON sandboxes (template)",
        ],
    ),
    (
        7,
        &[
            // Each sandbox's egress policy (JSON); goes with the sandbox's record.
            "CREATE TABLE sandbox_network (
            sandbox_id TEXT PRIMARY KEY NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
            policy TEXT NOT NULL,
            updated_at_ms BIGINT NOT NULL
        )",
            // Every outbound attempt of a sandbox; outlives the sandbox. Ids come from
            // the daemon, which streams an entry before it is written.
            "CREATE TABLE network_audit (
            id BIGINT PRIMARY KEY NOT NULL,
            at_ms BIGINT NOT NULL,
            sandbox_id TEXT NOT NULL,
            owner TEXT NOT NULL,
            protocol TEXT NOT NULL,
            dest_name TEXT,
            dest_ip TEXT,
            dest_port BIGINT NOT NULL,
            sni TEXT,
            http_host TEXT,
            verdict TEXT NOT NULL,
            rule TEXT NOT NULL,
            bytes_sent BIGINT NOT NULL,
            bytes_received BIGINT NOT NULL,
            ended_at_ms BIGINT,
            error TEXT
        )",
            "CREATE INDEX network_audit_owner_idx ON network_audit (owner, id)",
            "CREATE INDEX network_audit_sandbox_idx ON network_audit (sandbox_id, id)",
            "CREATE INDEX network_audit_at_idx ON network_audit (at_ms)",
        ],
    ),
    (
        8,
        &[
            // Credential broker secrets: the value only sealed by the daemon's broker key.
            "CREATE TABLE secrets (
            owner TEXT NOT NULL,
            name TEXT NOT NULL,
            sealed BLOB NOT NULL,
            spec TEXT NOT NULL,
            expires_at_ms BIGINT,
            created_at_ms BIGINT NOT NULL,
            PRIMARY KEY (owner, name)
        )",
            // Which secrets of its owner a sandbox may use; goes with the sandbox.
            "CREATE TABLE sandbox_secrets (
            sandbox_id TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
            name TEXT NOT NULL,
            PRIMARY KEY (sandbox_id, name)
        )",
        ],
    ),
    (
        9,
        &[
            // Credentials of the data-plane proxy; they go with the sandbox's record.
            "CREATE TABLE sandbox_access (
            sandbox_id TEXT PRIMARY KEY NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
            envd_token TEXT NOT NULL,
            traffic_token TEXT NOT NULL,
            secure BOOLEAN NOT NULL,
            public BOOLEAN NOT NULL,
            updated_at_ms BIGINT NOT NULL
        )",
        ],
    ),
    (
        10,
        &[
            // Identical audit entries within a minute are one row: how many it stands for
            // and when the last came (NULL while there is one).
            "ALTER TABLE network_audit ADD COLUMN count BIGINT NOT NULL DEFAULT 1",
            "ALTER TABLE network_audit ADD COLUMN last_at_ms BIGINT",
        ],
    ),
    (
        11,
        &[
            // Agent runtimes: a harness in one sandbox. No foreign key to the sandbox: a
            // runtime and its runs outlive the sandbox's record as history (ended).
            "CREATE TABLE agent_runtimes (
            id TEXT PRIMARY KEY NOT NULL,
            sandbox_id TEXT NOT NULL,
            owner TEXT NOT NULL,
            harness TEXT NOT NULL,
            harness_version TEXT,
            harness_template TEXT,
            approval_policy TEXT NOT NULL,
            session_id TEXT,
            state TEXT NOT NULL,
            reason TEXT,
            created_at_ms BIGINT NOT NULL,
            updated_at_ms BIGINT NOT NULL,
            ended_at_ms BIGINT
        )",
            "CREATE INDEX agent_runtimes_sandbox_idx ON agent_runtimes (sandbox_id, created_at_ms, id)",
            "CREATE INDEX agent_runtimes_owner_idx ON agent_runtimes (owner, created_at_ms, id)",
            // Runs of a runtime, numbered 1, 2, ... within it. `next_seq` is the sequence
            // number the run's next event gets; `max_events` its cap, fixed at start.
            "CREATE TABLE agent_runs (
            id TEXT PRIMARY KEY NOT NULL,
            runtime_id TEXT NOT NULL REFERENCES agent_runtimes (id) ON DELETE CASCADE,
            number BIGINT NOT NULL,
            sandbox_id TEXT NOT NULL,
            owner TEXT NOT NULL,
            task TEXT NOT NULL,
            mode TEXT NOT NULL,
            parent_run_id TEXT,
            resume_session_id TEXT,
            session_id TEXT,
            idempotency_key TEXT,
            state TEXT NOT NULL,
            reason TEXT,
            created_at_ms BIGINT NOT NULL,
            started_at_ms BIGINT,
            ended_at_ms BIGINT,
            updated_at_ms BIGINT NOT NULL,
            next_seq BIGINT NOT NULL,
            max_events BIGINT NOT NULL,
            events_dropped BIGINT NOT NULL,
            UNIQUE (runtime_id, number)
        )",
            // NULL keys are distinct in SQLite and PostgreSQL alike: runs without a key
            // never collide.
            "CREATE UNIQUE INDEX agent_runs_idempotency_idx ON agent_runs (runtime_id, idempotency_key)",
            // At most one active run per runtime, whatever path the insert took.
            "CREATE UNIQUE INDEX agent_runs_active_idx ON agent_runs (runtime_id) \
             WHERE state IN ('queued', 'running', 'waiting_approval')",
            "CREATE INDEX agent_runs_sandbox_idx ON agent_runs (sandbox_id, state)",
            "CREATE INDEX agent_runs_state_idx ON agent_runs (state)",
            "CREATE TABLE agent_run_events (
            run_id TEXT NOT NULL REFERENCES agent_runs (id) ON DELETE CASCADE,
            seq BIGINT NOT NULL,
            at_ms BIGINT NOT NULL,
            kind TEXT NOT NULL,
            payload TEXT NOT NULL,
            PRIMARY KEY (run_id, seq)
        )",
            // Requests for a person's decision, kept after the decision.
            "CREATE TABLE agent_approvals (
            id TEXT PRIMARY KEY NOT NULL,
            run_id TEXT NOT NULL REFERENCES agent_runs (id) ON DELETE CASCADE,
            runtime_id TEXT NOT NULL,
            sandbox_id TEXT NOT NULL,
            owner TEXT NOT NULL,
            capability TEXT NOT NULL,
            host TEXT,
            method TEXT,
            path TEXT,
            target_name TEXT,
            summary TEXT NOT NULL,
            detail TEXT NOT NULL,
            scope TEXT NOT NULL,
            state TEXT NOT NULL,
            decided_by TEXT,
            decided_at_ms BIGINT,
            expires_at_ms BIGINT NOT NULL,
            created_at_ms BIGINT NOT NULL
        )",
            "CREATE INDEX agent_approvals_owner_idx ON agent_approvals (owner, state, created_at_ms)",
            "CREATE INDEX agent_approvals_run_idx ON agent_approvals (run_id, state)",
            "CREATE INDEX agent_approvals_expiry_idx ON agent_approvals (state, expires_at_ms)",
        ],
    ),
    (
        12,
        &[
            // The model endpoint a runtime's harness is pointed at (JSON the daemon reads;
            // a secret's name, never a key).
            "ALTER TABLE agent_runtimes ADD COLUMN model TEXT NOT NULL DEFAULT '{}'",
        ],
    ),
    (
        13,
        &[
            // Roles of an API key, comma-separated (`approver` decides approvals when the
            // daemon requires it); existing keys have none.
            "ALTER TABLE api_keys ADD COLUMN roles TEXT NOT NULL DEFAULT ''",
            // Why an approval was denied, kept with the decision.
            "ALTER TABLE agent_approvals ADD COLUMN reason TEXT",
        ],
    ),
    (
        14,
        &[
            // Names of the sandbox's env variables whose values are secret (a JSON array):
            // never shown by the API, masked in its agent runs' events.
            "ALTER TABLE sandboxes ADD COLUMN secret_env TEXT NOT NULL DEFAULT '[]'",
        ],
    ),
    (
        16,
        &[
            // Per-sandbox metrics history: a sample every few seconds while running, gone
            // with the sandbox's record and pruned past the retention.
            "CREATE TABLE sandbox_metrics (
            sandbox_id TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
            at_ms BIGINT NOT NULL,
            cpu_count BIGINT NOT NULL,
            cpu_used_pct DOUBLE PRECISION NOT NULL,
            mem_used BIGINT NOT NULL,
            mem_total BIGINT NOT NULL,
            mem_cache BIGINT NOT NULL,
            disk_used BIGINT NOT NULL,
            disk_total BIGINT NOT NULL,
            net_rx BIGINT NOT NULL,
            net_tx BIGINT NOT NULL,
            PRIMARY KEY (sandbox_id, at_ms)
        )",
            // Pruning by age.
            "CREATE INDEX sandbox_metrics_at_idx ON sandbox_metrics (at_ms)",
        ],
    ),
    (
        17,
        &[
            // What E2B's /secrets API adds to a broker secret: its id, version and
            // metadata. A secret with such a row goes out only through a sandbox's rules.
            "CREATE TABLE e2b_secrets (
            owner TEXT NOT NULL,
            name TEXT NOT NULL,
            id TEXT NOT NULL UNIQUE,
            version BIGINT NOT NULL,
            metadata TEXT NOT NULL,
            updated_at_ms BIGINT NOT NULL,
            PRIMARY KEY (owner, name),
            FOREIGN KEY (owner, name) REFERENCES secrets (owner, name) ON DELETE CASCADE
        )",
            // A sandbox's egress header rules (E2B's network `rules`), as JSON the broker
            // interprets; they go with the sandbox.
            "CREATE TABLE sandbox_egress_rules (
            sandbox_id TEXT PRIMARY KEY NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
            rules TEXT NOT NULL
        )",
        ],
    ),
    (
        18,
        &[
            // Templates built through E2B's build API: per owner, by name.
            "CREATE TABLE e2b_templates (
            id TEXT PRIMARY KEY NOT NULL,
            owner TEXT NOT NULL,
            name TEXT NOT NULL,
            cpu_count BIGINT NOT NULL,
            memory_mb BIGINT NOT NULL,
            created_at_ms BIGINT NOT NULL,
            updated_at_ms BIGINT NOT NULL,
            UNIQUE (owner, name)
        )",
            // Their builds; a ready build names the sandpit template it made.
            "CREATE TABLE e2b_builds (
            id TEXT PRIMARY KEY NOT NULL,
            template_id TEXT NOT NULL REFERENCES e2b_templates (id) ON DELETE CASCADE,
            status TEXT NOT NULL,
            template TEXT,
            reason TEXT,
            step TEXT,
            tags TEXT NOT NULL DEFAULT '[]',
            created_at_ms BIGINT NOT NULL,
            updated_at_ms BIGINT NOT NULL
        )",
            "CREATE INDEX e2b_builds_template_idx ON e2b_builds (template_id, created_at_ms)",
            // Whose a sandpit template is, asked at every create.
            "CREATE INDEX e2b_builds_sandpit_idx ON e2b_builds (template)",
            // Tags name builds (`name:tag`); `default` is the one a bare name starts.
            "CREATE TABLE e2b_tags (
            template_id TEXT NOT NULL REFERENCES e2b_templates (id) ON DELETE CASCADE,
            tag TEXT NOT NULL,
            build_id TEXT NOT NULL,
            created_at_ms BIGINT NOT NULL,
            PRIMARY KEY (template_id, tag)
        )",
        ],
    ),
];

/// Highest schema version this build knows.
pub const SCHEMA_VERSION: i64 = 18;

/// Brings the database up to [`SCHEMA_VERSION`]; a no-op when it is already there.
pub(crate) async fn apply(pool: &SqlitePool) -> Result<(), StoreError> {
    // IMMEDIATE takes the write lock before reading the version, so two processes opening
    // the same fresh file cannot both decide to run the same migration.
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS schema_version (
            version BIGINT PRIMARY KEY NOT NULL,
            applied_at_ms BIGINT NOT NULL
        )",
    )
    .execute(&mut *tx)
    .await?;
    let (current,): (i64,) = sqlx::query_as("SELECT COALESCE(MAX(version), 0) FROM schema_version")
        .fetch_one(&mut *tx)
        .await?;
    if current > SCHEMA_VERSION {
        return Err(StoreError::SchemaTooNew {
            found: current,
            supported: SCHEMA_VERSION,
        });
    }
    // Versions are handed out per feature and may land out of order (a database made by a
    // build with 1, 2, 6 later meets 3): every migration not yet recorded runs.
    let applied: Vec<(i64,)> = sqlx::query_as("SELECT version FROM schema_version")
        .fetch_all(&mut *tx)
        .await?;
    let missing = MIGRATIONS
        .iter()
        .filter(|(v, _)| !applied.iter().any(|(a,)| a == v));
    for (version, statements) in missing {
        tracing::info!(version, "applying store schema migration");
        for statement in statements.iter() {
            sqlx::query(statement).execute(&mut *tx).await?;
        }
        sqlx::query("INSERT INTO schema_version (version, applied_at_ms) VALUES ($1, $2)")
            .bind(version)
            .bind(crate::now_ms())
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}
