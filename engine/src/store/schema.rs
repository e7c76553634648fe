//! The store's schema: the migrations from each version to the next, and the
//! indexes made at every open.

pub(super) const MIGRATIONS: &[&str] = &[
    // 0 -> 1
    r#"
    CREATE TABLE distributors (
        id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, spec TEXT NOT NULL,
        runtime TEXT NOT NULL DEFAULT '{}', created_at INTEGER NOT NULL);
    CREATE TABLE groups (
        id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, distributor_id TEXT NOT NULL,
        spec TEXT NOT NULL, config_version INTEGER NOT NULL DEFAULT 1,
        created_at INTEGER NOT NULL);
    CREATE TABLE group_secrets (group_id TEXT PRIMARY KEY, token TEXT NOT NULL);
    CREATE TABLE se_groups (
        id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, group_id TEXT NOT NULL,
        spec TEXT NOT NULL, created_at INTEGER NOT NULL);
    CREATE TABLE vservers (
        id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, se_group_id TEXT NOT NULL,
        spec TEXT NOT NULL, created_at INTEGER NOT NULL);
    CREATE TABLE nodes (
        id TEXT PRIMARY KEY, group_id TEXT NOT NULL, az TEXT NOT NULL,
        seq INTEGER NOT NULL, state TEXT NOT NULL, private_ip TEXT NOT NULL,
        public_ip TEXT, registered INTEGER NOT NULL DEFAULT 0,
        handle TEXT NOT NULL DEFAULT '{}', created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL);
    CREATE INDEX nodes_by_group ON nodes (group_id, az);
    CREATE TABLE addresses (address TEXT PRIMARY KEY, owner TEXT NOT NULL);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT, time_ms INTEGER NOT NULL,
        group_id TEXT NOT NULL, az TEXT, kind TEXT NOT NULL, reason TEXT NOT NULL);
    CREATE INDEX events_by_group ON events (group_id, id);
    CREATE TABLE leases (
        group_id TEXT PRIMARY KEY, holder TEXT NOT NULL, fence INTEGER NOT NULL,
        expires_ms INTEGER NOT NULL);
    "#,
    // 1 -> 2: the daemon's per-AZ policy state, so that a restarted daemon (or
    // one that takes a group over) resumes a running cooldown or back-off.
    // `holder` and `fence` are the daemon claim it was written under.
    r#"
    CREATE TABLE policy_state (
        group_id TEXT NOT NULL, az TEXT NOT NULL, state TEXT NOT NULL,
        holder TEXT NOT NULL, fence INTEGER NOT NULL, updated_at INTEGER NOT NULL,
        PRIMARY KEY (group_id, az));
    "#,
    // 2 -> 3: how many nodes each vserver spans in each AZ, as the daemon sized
    // it from the CPU of the nodes that hold it (none: `min_scaleout_per_vs`).
    r#"
    CREATE TABLE vserver_spans (
        vserver_id TEXT NOT NULL, az TEXT NOT NULL, span INTEGER NOT NULL,
        PRIMARY KEY (vserver_id, az));
    "#,
    // 3 -> 4: a version per group row, raised whenever the group's spec (or its
    // distributor's) changes, so that the daemon re-reads only the groups that
    // changed instead of every spec at every tick.
    r#"
    ALTER TABLE groups ADD COLUMN version INTEGER NOT NULL DEFAULT 1;
    "#,
    // 4 -> 5: an event repeated (same AZ, kind and reason as the group's latest)
    // is one row: how many times, and when last (`time_ms` is the first).
    r#"
    ALTER TABLE events ADD COLUMN count INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE events ADD COLUMN last_ms INTEGER NOT NULL DEFAULT 0;
    UPDATE events SET last_ms = time_ms;
    CREATE INDEX events_by_age ON events (group_id, last_ms);
    "#,
    // 5 -> 6: what each distributor's driver last confirmed it serves (its
    // settings and publication, as JSON; NULL: nothing confirmed yet), so that a publication
    // that failed is seen as unfinished work and retried until it is served.
    r#"
    ALTER TABLE distributors ADD COLUMN served TEXT;
    "#,
    // 6 -> 7: a group whose destroy began: whoever runs next (the daemon, the
    // next destroy) finishes the deletion instead of bringing it back up.
    r#"
    ALTER TABLE groups ADD COLUMN deleting INTEGER NOT NULL DEFAULT 0;
    "#,
    // 7 -> 8: the fence of the group's node configurations, raised (fenced by
    // the pusher's lease) before each configuration is read: a node refuses a
    // configuration with a lower one than it applied (see
    // [`Store::next_config_fence`]).
    r#"
    ALTER TABLE groups ADD COLUMN config_fence INTEGER NOT NULL DEFAULT 0;
    "#,
];

/// Indexes that a store of any version may have or lack, made at every open
/// without raising the schema version: an older lbscale still opens the
/// store (several daemons upgraded one by one, an older provider) and ignores
/// them.
pub(super) const INDEXES: &str = r#"
    -- Every evaluation asks whether its group's distributor has other groups
    -- (see `Store::group_record`), and a store may hold 10,000 groups.
    CREATE INDEX IF NOT EXISTS groups_by_distributor ON groups (distributor_id);
"#;
