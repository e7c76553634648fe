//! The store that the provider and the daemon share: a SQLite file by default.
//!
//! - Versioned migrations: `meta.schema_version` says which ones ran; a store written
//!   by a newer lbscale is refused rather than misread.
//! - Several processes at once: WAL journal, a busy timeout, and short transactions.
//!   Two writers never act on one group at the same time: they hold the group's
//!   lease (`acquire_lease`), whose fencing token increases with every new holder.
//! - The file is created readable by its owner only: it holds the groups' node API
//!   tokens.

use crate::model::{DistributorSpec, GroupSpec, SeGroupSpec, VserverSpec};
use lbscale_core::policy::AzState;
use rusqlite::{params, Connection, OptionalExtension};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The schema version this build writes. Each entry of `MIGRATIONS` moves the store
/// from version `i` to `i + 1`.
pub const SCHEMA_VERSION: i64 = 2;

const MIGRATIONS: &[&str] = &[
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
];

/// How long a call waits for another process's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "the store URL {0:?} is not supported: use sqlite://PATH (postgres:// is not built yet)"
    )]
    UnsupportedUrl(String),
    #[error("cannot open the store at {path}: {source}")]
    Open {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("the store at {path} is not an lbscale store or is corrupt ({detail}); it was left untouched")]
    Corrupt { path: PathBuf, detail: String },
    #[error("the store at {path} has schema version {found}, newer than this lbscale understands ({SCHEMA_VERSION}); upgrade lbscale. The store was left untouched")]
    TooNew { path: PathBuf, found: i64 },
    #[error("the store is locked by another process; gave up waiting for its lock after the busy timeout: {0}")]
    Locked(String),
    #[error("store: {0}")]
    Sql(String),
    #[error("store: a stored {what} could not be read: {detail}")]
    Decode { what: &'static str, detail: String },
    #[error(
        "{kind} {name:?} already exists in the store (id {id}); import it or choose another name"
    )]
    NameTaken {
        kind: &'static str,
        name: String,
        id: String,
    },
    #[error(
        "group {group} is being worked on by {holder} (lease until {expires_in_ms} ms from now)"
    )]
    LeaseHeld {
        group: String,
        holder: String,
        expires_in_ms: i64,
    },
    /// A lease this process held was taken over or expired: stop before the next
    /// side effect (the new holder owns the group now).
    #[error("lost the lease on group {group}: {detail}")]
    LeaseLost { group: String, detail: String },
    /// A claim on a group that is no longer in the store (destroyed meanwhile).
    #[error("group {0} is not in the store (destroyed)")]
    GroupGone(String),
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        match &e {
            rusqlite::Error::SqliteFailure(f, _)
                if matches!(
                    f.code,
                    rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
                ) =>
            {
                StoreError::Locked(e.to_string())
            }
            _ => StoreError::Sql(e.to_string()),
        }
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A row of a declared object: its id and its spec.
#[derive(Debug, Clone)]
pub struct Row<T> {
    pub id: String,
    pub spec: T,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRow {
    pub id: String,
    pub group_id: String,
    pub az: String,
    /// Creation order within the group: the newest node has the highest `seq`.
    pub seq: i64,
    pub state: NodeState,
    pub private_ip: String,
    pub public_ip: Option<String>,
    /// Whether the node's address is in the traffic distributor.
    pub registered: bool,
    /// Driver-specific handle (for `local`: the process id and paths).
    pub handle: serde_json::Value,
    pub created_at: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    Provisioning,
    Joining,
    Active,
    Draining,
    Deprovisioning,
    Gone,
    Failed,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Provisioning => "provisioning",
            NodeState::Joining => "joining",
            NodeState::Active => "active",
            NodeState::Draining => "draining",
            NodeState::Deprovisioning => "deprovisioning",
            NodeState::Gone => "gone",
            NodeState::Failed => "failed",
        }
    }
    fn parse(s: &str) -> Result<Self> {
        serde_json::from_value(serde_json::Value::String(s.into())).map_err(|e| {
            StoreError::Decode {
                what: "node state",
                detail: e.to_string(),
            }
        })
    }
    /// Counts towards the cluster size (not on its way out).
    pub fn is_member(self) -> bool {
        matches!(
            self,
            NodeState::Provisioning | NodeState::Joining | NodeState::Active
        )
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub time_ms: i64,
    pub group_id: String,
    pub az: Option<String>,
    pub kind: String,
    pub reason: String,
}

/// The lease by which a daemon claims a group for its evaluations (kept in the
/// `leases` table next to the group's own lease, which workflows take).
pub fn daemon_claim_key(group_id: &str) -> String {
    format!("daemon/{group_id}")
}

/// One AZ's policy state as the daemon last persisted it.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyStateRow {
    pub group_id: String,
    pub az: String,
    pub state: AzState,
    /// The daemon claim it was written under.
    pub holder: String,
    pub fence: i64,
    /// Unix ms of the write.
    pub updated_at: i64,
}

/// A held lease: act on the group only while it is valid, and pass `fence` with
/// every side effect so that a stale holder can be told apart.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub group_id: String,
    pub holder: String,
    pub fence: i64,
    pub expires_ms: i64,
}

pub struct Store {
    path: PathBuf,
    conn: Mutex<Connection>,
}

impl Store {
    /// Opens `sqlite://PATH`; a relative PATH is taken from `base_dir`.
    pub fn open_url(url: &str, base_dir: &Path) -> Result<Store> {
        let Some(rest) = url.strip_prefix("sqlite://") else {
            return Err(StoreError::UnsupportedUrl(url.to_string()));
        };
        if rest.is_empty() {
            return Err(StoreError::UnsupportedUrl(url.to_string()));
        }
        let path = if Path::new(rest).is_absolute() {
            PathBuf::from(rest)
        } else {
            base_dir.join(rest)
        };
        Store::open(&path)
    }

    pub fn open(path: &Path) -> Result<Store> {
        Store::open_with_busy_timeout(path, BUSY_TIMEOUT)
    }

    /// Opens the store; a call waits at most `busy_timeout` for another
    /// process's lock before failing with [`StoreError::Locked`].
    pub fn open_with_busy_timeout(path: &Path, busy_timeout: Duration) -> Result<Store> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Open {
                path: path.to_path_buf(),
                source: rusqlite::Error::InvalidPath(PathBuf::from(e.to_string())),
            })?;
        }
        let existed = path.exists();
        let conn = Connection::open(path).map_err(|source| StoreError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        if !existed {
            restrict_to_owner(path);
        }
        conn.busy_timeout(busy_timeout)?;
        let corrupt = |e: rusqlite::Error| StoreError::Corrupt {
            path: path.to_path_buf(),
            detail: e.to_string(),
        };
        // Reading the schema is the first thing that fails on a file that is not
        // a database; report that, instead of a bare SQL error.
        conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| {
            r.get::<_, i64>(0)
        })
        .map_err(|e| match StoreError::from(e) {
            StoreError::Locked(m) => StoreError::Locked(m),
            StoreError::Sql(m) => StoreError::Corrupt {
                path: path.to_path_buf(),
                detail: m,
            },
            other => other,
        })?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(StoreError::from)?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(corrupt)?;
        let store = Store {
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
        };
        store.migrate()?;
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn migrate(&self) -> Result<()> {
        let mut conn = self.conn.lock().unwrap();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        )?;
        let tables: i64 = tx.query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name != 'meta'",
            [],
            |r| r.get(0),
        )?;
        let version: Option<String> = tx
            .query_row(
                "SELECT value FROM meta WHERE key = 'schema_version'",
                [],
                |r| r.get(0),
            )
            .optional()?;
        let version: i64 = match version {
            Some(v) => v.parse().map_err(|_| StoreError::Corrupt {
                path: self.path.clone(),
                detail: format!("schema_version is {v:?}"),
            })?,
            None if tables > 0 => {
                return Err(StoreError::Corrupt {
                    path: self.path.clone(),
                    detail: "it has tables but no lbscale schema version".into(),
                })
            }
            None => 0,
        };
        if version > SCHEMA_VERSION {
            return Err(StoreError::TooNew {
                path: self.path.clone(),
                found: version,
            });
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            tx.execute_batch(sql)?;
            tx.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', ?1)
                 ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                params![(i + 1).to_string()],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    fn with<T>(&self, f: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> Result<T> {
        let conn = self.conn.lock().unwrap();
        f(&conn).map_err(StoreError::from)
    }

    fn tx<T>(&self, f: impl FnOnce(&rusqlite::Transaction) -> Result<T>) -> Result<T> {
        let mut conn = self.conn.lock().unwrap();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let out = f(&tx)?;
        tx.commit()?;
        Ok(out)
    }

    // --- declared objects -------------------------------------------------------

    fn insert_named<T: Serialize>(
        &self,
        kind: &'static str,
        sql: &str,
        id: &str,
        name: &str,
        parent: &str,
        spec: &T,
    ) -> Result<()> {
        let table = table_of(kind);
        let spec = serde_json::to_string(spec).expect("specs serialise");
        self.tx(|tx| {
            let taken: Option<String> = tx
                .query_row(
                    &format!("SELECT id FROM {table} WHERE name = ?1"),
                    params![name],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(existing) = taken {
                return Err(StoreError::NameTaken {
                    kind,
                    name: name.to_string(),
                    id: existing,
                });
            }
            tx.execute(sql, params![id, name, parent, spec, now_ms()])?;
            Ok(())
        })
    }

    fn update_named<T: Serialize>(
        &self,
        kind: &'static str,
        id: &str,
        name: &str,
        parent: &str,
        spec: &T,
    ) -> Result<()> {
        let table = table_of(kind);
        let parent_col = parent_column(kind);
        let spec = serde_json::to_string(spec).expect("specs serialise");
        self.tx(|tx| {
            let taken: Option<String> = tx
                .query_row(
                    &format!("SELECT id FROM {table} WHERE name = ?1 AND id != ?2"),
                    params![name, id],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(existing) = taken {
                return Err(StoreError::NameTaken {
                    kind,
                    name: name.to_string(),
                    id: existing,
                });
            }
            tx.execute(
                &format!(
                    "UPDATE {table} SET name = ?2, {parent_col} = ?3, spec = ?4 WHERE id = ?1"
                ),
                params![id, name, parent, spec],
            )?;
            Ok(())
        })
    }

    fn get_by<T: DeserializeOwned>(
        &self,
        kind: &'static str,
        column: &str,
        value: &str,
    ) -> Result<Option<Row<T>>> {
        let table = table_of(kind);
        let row: Option<(String, String)> = self.with(|c| {
            c.query_row(
                &format!("SELECT id, spec FROM {table} WHERE {column} = ?1"),
                params![value],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
        })?;
        row.map(|(id, spec)| decode(kind, &spec).map(|spec| Row { id, spec }))
            .transpose()
    }

    fn list_by<T: DeserializeOwned>(
        &self,
        kind: &'static str,
        column: &str,
        value: &str,
    ) -> Result<Vec<Row<T>>> {
        let table = table_of(kind);
        let rows: Vec<(String, String)> = self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT id, spec FROM {table} WHERE {column} = ?1 ORDER BY created_at, id"
            ))?;
            let rows = st.query_map(params![value], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect()
        })?;
        rows.into_iter()
            .map(|(id, spec)| decode(kind, &spec).map(|spec| Row { id, spec }))
            .collect()
    }

    fn delete_row(&self, kind: &'static str, id: &str) -> Result<()> {
        let table = table_of(kind);
        self.with(|c| c.execute(&format!("DELETE FROM {table} WHERE id = ?1"), params![id]))?;
        Ok(())
    }

    pub fn insert_distributor(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        self.insert_named(
            "traffic distributor",
            // A distributor has no parent: ?3 is always empty.
            "INSERT INTO distributors (id, name, spec, created_at) SELECT ?1, ?2, ?4, ?5 WHERE ?3 = ''",
            id,
            &spec.name,
            "",
            spec,
        )
    }
    pub fn update_distributor(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        let s = serde_json::to_string(spec).expect("specs serialise");
        self.with(|c| {
            c.execute(
                "UPDATE distributors SET spec = ?2 WHERE id = ?1",
                params![id, s],
            )
        })?;
        Ok(())
    }
    pub fn distributor(&self, id: &str) -> Result<Option<Row<DistributorSpec>>> {
        self.get_by("traffic distributor", "id", id)
    }
    pub fn distributor_by_name(&self, name: &str) -> Result<Option<Row<DistributorSpec>>> {
        self.get_by("traffic distributor", "name", name)
    }
    pub fn delete_distributor(&self, id: &str) -> Result<()> {
        self.delete_row("traffic distributor", id)
    }
    /// Driver state of a distributor (for `local`: process, addresses, config version).
    pub fn distributor_runtime(&self, id: &str) -> Result<serde_json::Value> {
        let s: Option<String> = self.with(|c| {
            c.query_row(
                "SELECT runtime FROM distributors WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()
        })?;
        s.map_or(Ok(serde_json::Value::Null), |s| {
            decode("distributor runtime", &s)
        })
    }
    pub fn set_distributor_runtime(&self, id: &str, runtime: &serde_json::Value) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE distributors SET runtime = ?2 WHERE id = ?1",
                params![id, runtime.to_string()],
            )
        })?;
        Ok(())
    }

    pub fn insert_group(&self, id: &str, spec: &GroupSpec, token: &str) -> Result<()> {
        self.insert_named(
            "autoscale group",
            "INSERT INTO groups (id, name, distributor_id, spec, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
            id,
            &spec.name,
            &spec.traffic_distributor_id,
            spec,
        )?;
        self.with(|c| {
            c.execute(
                "INSERT INTO group_secrets (group_id, token) VALUES (?1, ?2)",
                params![id, token],
            )
        })?;
        Ok(())
    }
    pub fn update_group(&self, id: &str, spec: &GroupSpec) -> Result<()> {
        self.update_named(
            "autoscale group",
            id,
            &spec.name,
            &spec.traffic_distributor_id,
            spec,
        )
    }
    pub fn group(&self, id: &str) -> Result<Option<Row<GroupSpec>>> {
        self.get_by("autoscale group", "id", id)
    }
    pub fn group_by_name(&self, name: &str) -> Result<Option<Row<GroupSpec>>> {
        self.get_by("autoscale group", "name", name)
    }
    pub fn groups_of_distributor(&self, distributor_id: &str) -> Result<Vec<Row<GroupSpec>>> {
        self.list_by("autoscale group", "distributor_id", distributor_id)
    }
    pub fn all_groups(&self) -> Result<Vec<Row<GroupSpec>>> {
        let rows: Vec<(String, String)> = self.with(|c| {
            let mut st = c.prepare("SELECT id, spec FROM groups ORDER BY created_at, id")?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect()
        })?;
        rows.into_iter()
            .map(|(id, spec)| decode("autoscale group", &spec).map(|spec| Row { id, spec }))
            .collect()
    }
    /// The group's node API token. Sensitive: never log or print it.
    pub fn group_token(&self, group_id: &str) -> Result<Option<String>> {
        self.with(|c| {
            c.query_row(
                "SELECT token FROM group_secrets WHERE group_id = ?1",
                params![group_id],
                |r| r.get(0),
            )
            .optional()
        })
    }
    /// Bumps the version of the configuration that the group's nodes must run.
    pub fn bump_config_version(&self, group_id: &str) -> Result<u64> {
        self.with(|c| {
            c.execute(
                "UPDATE groups SET config_version = config_version + 1 WHERE id = ?1",
                params![group_id],
            )?;
            c.query_row(
                "SELECT config_version FROM groups WHERE id = ?1",
                params![group_id],
                |r| r.get::<_, i64>(0),
            )
        })
        .map(|v| v as u64)
    }
    pub fn config_version(&self, group_id: &str) -> Result<u64> {
        self.with(|c| {
            c.query_row(
                "SELECT config_version FROM groups WHERE id = ?1",
                params![group_id],
                |r| r.get::<_, i64>(0),
            )
            .optional()
        })
        .map(|v| v.unwrap_or(0) as u64)
    }
    /// Deletes the group with its secret, leases (its own and the daemon's claim),
    /// events and policy state (its nodes must be gone).
    pub fn delete_group(&self, id: &str) -> Result<()> {
        let claim = daemon_claim_key(id);
        self.tx(|tx| {
            for sql in [
                "DELETE FROM nodes WHERE group_id = ?1",
                "DELETE FROM group_secrets WHERE group_id = ?1",
                "DELETE FROM events WHERE group_id = ?1",
                "DELETE FROM policy_state WHERE group_id = ?1",
                "DELETE FROM leases WHERE group_id = ?1",
                "DELETE FROM groups WHERE id = ?1",
            ] {
                tx.execute(sql, params![id])?;
            }
            tx.execute("DELETE FROM leases WHERE group_id = ?1", params![claim])?;
            Ok(())
        })
    }

    // --- policy state -----------------------------------------------------------

    /// Persists one AZ's policy state under the daemon's claim on the group
    /// (`claim` must be the lease [`daemon_claim_key`] of `group_id`). Refused with
    /// [`StoreError::LeaseLost`] unless the claim is the current, unexpired one and
    /// no newer claim (higher fence) wrote the row: a daemon that lost the group
    /// must not overwrite what its successor decided. The checks and the write are
    /// one transaction. A group that is gone gets nothing written (its deletion
    /// removed its rows; a late writer must not bring one back).
    pub fn put_policy_state(
        &self,
        claim: &Lease,
        group_id: &str,
        az: &str,
        state: &AzState,
    ) -> Result<()> {
        assert_eq!(
            claim.group_id,
            daemon_claim_key(group_id),
            "policy state is written under the group's daemon claim"
        );
        let json = serde_json::to_string(state).expect("policy state serialises");
        let now = now_ms();
        let lost = |detail: String| {
            Err(StoreError::LeaseLost {
                group: claim.group_id.clone(),
                detail,
            })
        };
        self.tx(|tx| {
            let cur: Option<(String, i64, i64)> = tx
                .query_row(
                    "SELECT holder, fence, expires_ms FROM leases WHERE group_id = ?1",
                    params![claim.group_id],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
                )
                .optional()?;
            match cur {
                Some((h, f, exp)) if h == claim.holder && f == claim.fence && exp > now => {}
                Some((h, f, _)) => {
                    return lost(format!(
                        "policy state not written: {h} holds the claim (fence {f}, ours was {}), or it expired",
                        claim.fence
                    ))
                }
                None => return lost("policy state not written: the claim is gone".into()),
            }
            let exists: i64 = tx.query_row(
                "SELECT count(*) FROM groups WHERE id = ?1",
                params![group_id],
                |r| r.get(0),
            )?;
            if exists == 0 {
                return Ok(());
            }
            let stored: Option<i64> = tx
                .query_row(
                    "SELECT fence FROM policy_state WHERE group_id = ?1 AND az = ?2",
                    params![group_id, az],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(f) = stored.filter(|f| *f > claim.fence) {
                return lost(format!(
                    "policy state not written: a newer claim (fence {f}) wrote it, ours is {}",
                    claim.fence
                ));
            }
            tx.execute(
                "INSERT INTO policy_state (group_id, az, state, holder, fence, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (group_id, az) DO UPDATE SET state = excluded.state,
                   holder = excluded.holder, fence = excluded.fence, updated_at = excluded.updated_at",
                params![group_id, az, json, claim.holder, claim.fence, now],
            )?;
            Ok(())
        })
    }

    /// The group's persisted policy state, one row per AZ (by AZ name).
    pub fn policy_states(&self, group_id: &str) -> Result<Vec<PolicyStateRow>> {
        let rows: Vec<(String, String, String, i64, i64)> = self.with(|c| {
            let mut st = c.prepare(
                "SELECT az, state, holder, fence, updated_at FROM policy_state
                 WHERE group_id = ?1 ORDER BY az",
            )?;
            let rows = st.query_map(params![group_id], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })?;
            rows.collect()
        })?;
        rows.into_iter()
            .map(|(az, state, holder, fence, updated_at)| {
                Ok(PolicyStateRow {
                    group_id: group_id.to_string(),
                    az,
                    state: decode("policy state", &state)?,
                    holder,
                    fence,
                    updated_at,
                })
            })
            .collect()
    }

    pub fn insert_se_group(&self, id: &str, spec: &SeGroupSpec) -> Result<()> {
        self.insert_named(
            "SE group",
            "INSERT INTO se_groups (id, name, group_id, spec, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
            id,
            &spec.name,
            &spec.autoscale_group_id,
            spec,
        )
    }
    pub fn update_se_group(&self, id: &str, spec: &SeGroupSpec) -> Result<()> {
        self.update_named("SE group", id, &spec.name, &spec.autoscale_group_id, spec)
    }
    pub fn se_group(&self, id: &str) -> Result<Option<Row<SeGroupSpec>>> {
        self.get_by("SE group", "id", id)
    }
    pub fn se_group_by_name(&self, name: &str) -> Result<Option<Row<SeGroupSpec>>> {
        self.get_by("SE group", "name", name)
    }
    pub fn se_groups_of_group(&self, group_id: &str) -> Result<Vec<Row<SeGroupSpec>>> {
        self.list_by("SE group", "group_id", group_id)
    }
    pub fn delete_se_group(&self, id: &str) -> Result<()> {
        self.delete_row("SE group", id)
    }

    pub fn insert_vserver(&self, id: &str, spec: &VserverSpec) -> Result<()> {
        self.insert_named(
            "vserver",
            "INSERT INTO vservers (id, name, se_group_id, spec, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
            id,
            &spec.name,
            &spec.se_group_id,
            spec,
        )
    }
    pub fn update_vserver(&self, id: &str, spec: &VserverSpec) -> Result<()> {
        self.update_named("vserver", id, &spec.name, &spec.se_group_id, spec)
    }
    pub fn vserver(&self, id: &str) -> Result<Option<Row<VserverSpec>>> {
        self.get_by("vserver", "id", id)
    }
    pub fn vserver_by_name(&self, name: &str) -> Result<Option<Row<VserverSpec>>> {
        self.get_by("vserver", "name", name)
    }
    pub fn vservers_of_se_group(&self, se_group_id: &str) -> Result<Vec<Row<VserverSpec>>> {
        self.list_by("vserver", "se_group_id", se_group_id)
    }
    pub fn delete_vserver(&self, id: &str) -> Result<()> {
        self.delete_row("vserver", id)
    }
    /// Every vserver placed on the group, through its SE groups.
    pub fn vservers_of_group(&self, group_id: &str) -> Result<Vec<Row<VserverSpec>>> {
        let mut out = Vec::new();
        for se in self.se_groups_of_group(group_id)? {
            out.extend(self.vservers_of_se_group(&se.id)?);
        }
        Ok(out)
    }

    // --- nodes ------------------------------------------------------------------

    pub fn next_node_seq(&self, group_id: &str) -> Result<i64> {
        self.with(|c| {
            c.query_row(
                "SELECT coalesce(max(seq), 0) + 1 FROM nodes WHERE group_id = ?1",
                params![group_id],
                |r| r.get(0),
            )
        })
    }
    pub fn insert_node(&self, n: &NodeRow) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT INTO nodes (id, group_id, az, seq, state, private_ip, public_ip, registered, handle, created_at, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10)",
                params![
                    n.id, n.group_id, n.az, n.seq, n.state.as_str(), n.private_ip, n.public_ip,
                    n.registered, n.handle.to_string(), n.created_at
                ],
            )
        })?;
        Ok(())
    }
    pub fn update_node(&self, n: &NodeRow) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE nodes SET state = ?2, registered = ?3, handle = ?4, updated_at = ?5,
                 private_ip = ?6, public_ip = ?7 WHERE id = ?1",
                params![
                    n.id,
                    n.state.as_str(),
                    n.registered,
                    n.handle.to_string(),
                    now_ms(),
                    n.private_ip,
                    n.public_ip
                ],
            )
        })?;
        Ok(())
    }
    pub fn delete_node(&self, id: &str) -> Result<()> {
        self.with(|c| c.execute("DELETE FROM nodes WHERE id = ?1", params![id]))?;
        Ok(())
    }
    /// The group's nodes, oldest first.
    pub fn nodes_of_group(&self, group_id: &str) -> Result<Vec<NodeRow>> {
        let rows: Vec<NodeRowRaw> = self.with(|c| {
            let mut st = c.prepare(
                "SELECT id, group_id, az, seq, state, private_ip, public_ip, registered, handle, created_at
                 FROM nodes WHERE group_id = ?1 ORDER BY seq",
            )?;
            let rows = st.query_map(params![group_id], |r| {
                Ok(NodeRowRaw {
                    id: r.get(0)?,
                    group_id: r.get(1)?,
                    az: r.get(2)?,
                    seq: r.get(3)?,
                    state: r.get(4)?,
                    private_ip: r.get(5)?,
                    public_ip: r.get(6)?,
                    registered: r.get(7)?,
                    handle: r.get(8)?,
                    created_at: r.get(9)?,
                })
            })?;
            rows.collect()
        })?;
        rows.into_iter()
            .map(|r| {
                Ok(NodeRow {
                    id: r.id,
                    group_id: r.group_id,
                    az: r.az,
                    seq: r.seq,
                    state: NodeState::parse(&r.state)?,
                    private_ip: r.private_ip,
                    public_ip: r.public_ip,
                    registered: r.registered,
                    handle: decode("node handle", &r.handle)?,
                    created_at: r.created_at,
                })
            })
            .collect()
    }

    // --- addresses --------------------------------------------------------------

    /// Reserves the first free address that `candidate` accepts, in the order given.
    pub fn reserve_address(
        &self,
        owner: &str,
        candidates: impl Iterator<Item = String>,
        mut usable: impl FnMut(&str) -> bool,
    ) -> Result<Option<String>> {
        for addr in candidates {
            let taken: bool = self.with(|c| {
                c.query_row(
                    "SELECT count(*) FROM addresses WHERE address = ?1",
                    params![addr],
                    |r| r.get::<_, i64>(0),
                )
            })? > 0;
            if taken || !usable(&addr) {
                continue;
            }
            let inserted = self.with(|c| {
                c.execute(
                    "INSERT OR IGNORE INTO addresses (address, owner) VALUES (?1, ?2)",
                    params![addr, owner],
                )
            })?;
            if inserted == 1 {
                return Ok(Some(addr));
            }
        }
        Ok(None)
    }
    pub fn release_addresses(&self, owner: &str) -> Result<()> {
        self.with(|c| c.execute("DELETE FROM addresses WHERE owner = ?1", params![owner]))?;
        Ok(())
    }

    // --- events -----------------------------------------------------------------

    pub fn record_event(
        &self,
        group_id: &str,
        az: Option<&str>,
        kind: &str,
        reason: &str,
    ) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT INTO events (time_ms, group_id, az, kind, reason) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![now_ms(), group_id, az, kind, reason],
            )
        })?;
        Ok(())
    }
    /// The most recent `limit` events of the group, oldest first.
    pub fn events_of_group(&self, group_id: &str, limit: usize) -> Result<Vec<Event>> {
        let mut rows: Vec<Event> = self.with(|c| {
            let mut st = c.prepare(
                "SELECT time_ms, group_id, az, kind, reason FROM events WHERE group_id = ?1 ORDER BY id DESC LIMIT ?2",
            )?;
            let rows = st.query_map(params![group_id, limit as i64], |r| {
                Ok(Event { time_ms: r.get(0)?, group_id: r.get(1)?, az: r.get(2)?, kind: r.get(3)?, reason: r.get(4)? })
            })?;
            rows.collect()
        })?;
        rows.reverse();
        Ok(rows)
    }

    // --- leases -----------------------------------------------------------------

    /// Takes the group's lease for `ttl` if it is free, expired, or already ours.
    /// A new holder gets a higher fencing token than every holder before it.
    pub fn acquire_lease(&self, group_id: &str, holder: &str, ttl: Duration) -> Result<Lease> {
        let now = now_ms();
        let expires = now + ttl.as_millis() as i64;
        self.tx(|tx| {
            // A daemon's claim on a group that is gone (destroyed between the
            // daemon listing the groups and claiming one) must not leave a row.
            if let Some(claimed) = group_id.strip_prefix("daemon/") {
                let exists: Option<i64> = tx
                    .query_row("SELECT 1 FROM groups WHERE id = ?1", params![claimed], |r| r.get(0))
                    .optional()?;
                if exists.is_none() {
                    return Err(StoreError::GroupGone(claimed.to_string()));
                }
            }
            let cur: Option<(String, i64, i64)> = tx
                .query_row("SELECT holder, fence, expires_ms FROM leases WHERE group_id = ?1", params![group_id], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })
                .optional()?;
            let fence = match cur {
                Some((h, fence, _)) if h == holder => fence,
                Some((h, _, exp)) if exp > now => {
                    return Err(StoreError::LeaseHeld { group: group_id.into(), holder: h, expires_in_ms: exp - now })
                }
                Some((_, fence, _)) => fence + 1,
                None => 1,
            };
            tx.execute(
                "INSERT INTO leases (group_id, holder, fence, expires_ms) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (group_id) DO UPDATE SET holder = excluded.holder, fence = excluded.fence, expires_ms = excluded.expires_ms",
                params![group_id, holder, fence, expires],
            )?;
            Ok(Lease { group_id: group_id.into(), holder: holder.into(), fence, expires_ms: expires })
        })
    }

    /// Gives up whatever lease `holder` has on `key`, without knowing its fence;
    /// unlike acquiring it to learn the fence, this never creates a row (a group
    /// that is gone keeps no lease).
    pub fn release_lease_of(&self, key: &str, holder: &str) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE leases SET expires_ms = 0 WHERE group_id = ?1 AND holder = ?2",
                params![key, holder],
            )
        })?;
        Ok(())
    }

    /// Gives the lease up at once (only if still ours).
    pub fn release_lease(&self, lease: &Lease) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE leases SET expires_ms = 0 WHERE group_id = ?1 AND holder = ?2 AND fence = ?3",
                params![lease.group_id, lease.holder, lease.fence],
            )
        })?;
        Ok(())
    }

    /// Extends a lease that is still ours (same holder and fence) to `ttl` from
    /// now; [`StoreError::LeaseLost`] when another holder took it over (or it
    /// was released). A lease that expired but that nobody took is still ours.
    pub fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let expires = now_ms() + ttl.as_millis() as i64;
        let n = self.with(|c| {
            c.execute(
                "UPDATE leases SET expires_ms = ?4 WHERE group_id = ?1 AND holder = ?2 AND fence = ?3 AND expires_ms > 0",
                params![lease.group_id, lease.holder, lease.fence, expires],
            )
        })?;
        if n == 0 {
            return Err(StoreError::LeaseLost {
                group: lease.group_id.clone(),
                detail: format!(
                    "{} no longer holds it (fence {})",
                    lease.holder, lease.fence
                ),
            });
        }
        Ok(Lease {
            expires_ms: expires,
            ..lease.clone()
        })
    }

    /// The fence check before a side effect: Ok only while `lease` is the
    /// group's current, unexpired lease.
    pub fn check_lease(&self, lease: &Lease) -> Result<()> {
        let cur: Option<(String, i64, i64)> = self.with(|c| {
            c.query_row(
                "SELECT holder, fence, expires_ms FROM leases WHERE group_id = ?1",
                params![lease.group_id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
        })?;
        let lost = |detail: String| {
            Err(StoreError::LeaseLost {
                group: lease.group_id.clone(),
                detail,
            })
        };
        match cur {
            None => lost("the lease is gone".into()),
            Some((h, f, _)) if h != lease.holder || f != lease.fence => lost(format!(
                "{h} holds it now (fence {f}, ours was {})",
                lease.fence
            )),
            Some((_, _, exp)) if exp <= now_ms() => lost("it expired".into()),
            Some(_) => Ok(()),
        }
    }

    /// Rows in one of the store's tables (tests use it to prove a clean destroy).
    pub fn count_rows(&self, table: &str) -> Result<i64> {
        const TABLES: &[&str] = &[
            "distributors",
            "groups",
            "group_secrets",
            "se_groups",
            "vservers",
            "nodes",
            "addresses",
            "events",
            "leases",
            "policy_state",
        ];
        if !TABLES.contains(&table) {
            return Err(StoreError::Sql(format!("no table {table:?}")));
        }
        self.with(|c| c.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0)))
    }

    /// Counts rows that mention the id anywhere (used by tests to prove a clean destroy).
    pub fn rows_mentioning(&self, id: &str) -> Result<i64> {
        let mut total = 0;
        for (table, col) in [
            ("distributors", "id"),
            ("groups", "id"),
            ("groups", "distributor_id"),
            ("group_secrets", "group_id"),
            ("se_groups", "id"),
            ("se_groups", "group_id"),
            ("vservers", "id"),
            ("vservers", "se_group_id"),
            ("nodes", "group_id"),
            ("events", "group_id"),
            ("leases", "group_id"),
            ("policy_state", "group_id"),
            ("addresses", "owner"),
        ] {
            total += self.with(|c| {
                c.query_row(
                    &format!("SELECT count(*) FROM {table} WHERE {col} = ?1"),
                    params![id],
                    |r| r.get::<_, i64>(0),
                )
            })?;
        }
        // A daemon's claim on a group is a lease keyed `daemon/<group>`.
        total += self.with(|c| {
            c.query_row(
                "SELECT count(*) FROM leases WHERE group_id = ?1",
                params![daemon_claim_key(id)],
                |r| r.get::<_, i64>(0),
            )
        })?;
        Ok(total)
    }
}

struct NodeRowRaw {
    id: String,
    group_id: String,
    az: String,
    seq: i64,
    state: String,
    private_ip: String,
    public_ip: Option<String>,
    registered: bool,
    handle: String,
    created_at: i64,
}

fn table_of(kind: &str) -> &'static str {
    match kind {
        "traffic distributor" => "distributors",
        "autoscale group" => "groups",
        "SE group" => "se_groups",
        "vserver" => "vservers",
        other => unreachable!("no table for {other}"),
    }
}

fn parent_column(kind: &str) -> &'static str {
    match kind {
        "autoscale group" => "distributor_id",
        "SE group" => "group_id",
        "vserver" => "se_group_id",
        other => unreachable!("no parent column for {other}"),
    }
}

fn decode<T: DeserializeOwned>(what: &'static str, s: &str) -> Result<T> {
    serde_json::from_str(s).map_err(|e| StoreError::Decode {
        what,
        detail: e.to_string(),
    })
}

#[cfg(unix)]
fn restrict_to_owner(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
}
#[cfg(not(unix))]
fn restrict_to_owner(_: &Path) {}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "lbscale-store-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d.join("state.db")
    }

    #[test]
    fn lease_excludes_a_second_holder_and_fences_the_next() {
        let s = Store::open(&tmp()).unwrap();
        let a = s.acquire_lease("g1", "a", Duration::from_secs(30)).unwrap();
        assert!(matches!(
            s.acquire_lease("g1", "b", Duration::from_secs(30)),
            Err(StoreError::LeaseHeld { .. })
        ));
        // Re-acquiring our own lease keeps the token.
        assert_eq!(
            s.acquire_lease("g1", "a", Duration::from_secs(30))
                .unwrap()
                .fence,
            a.fence
        );
        s.release_lease(&a).unwrap();
        let b = s.acquire_lease("g1", "b", Duration::from_secs(30)).unwrap();
        assert!(b.fence > a.fence);
    }

    #[test]
    fn a_renewed_lease_is_checked_and_a_taken_over_one_is_lost() {
        let s = Store::open(&tmp()).unwrap();
        let a = s
            .acquire_lease("g1", "a", Duration::from_millis(50))
            .unwrap();
        s.check_lease(&a).unwrap();
        let a = s.renew_lease(&a, Duration::from_secs(30)).unwrap();
        s.check_lease(&a).unwrap();
        // Expired and taken over by b: a's renewal and check both fail.
        let short = s.renew_lease(&a, Duration::from_millis(1)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(matches!(
            s.check_lease(&short),
            Err(StoreError::LeaseLost { .. })
        ));
        let b = s.acquire_lease("g1", "b", Duration::from_secs(30)).unwrap();
        assert!(matches!(
            s.renew_lease(&a, Duration::from_secs(30)),
            Err(StoreError::LeaseLost { .. })
        ));
        assert!(matches!(
            s.check_lease(&a),
            Err(StoreError::LeaseLost { .. })
        ));
        s.check_lease(&b).unwrap();
        // Released: renewing it does not bring it back.
        s.release_lease(&b).unwrap();
        assert!(s.renew_lease(&b, Duration::from_secs(30)).is_err());
    }

    #[test]
    fn lease_is_shared_across_processes_through_the_file() {
        let p = tmp();
        let s1 = Store::open(&p).unwrap();
        let s2 = Store::open(&p).unwrap();
        s1.acquire_lease("g", "one", Duration::from_secs(30))
            .unwrap();
        assert!(s2
            .acquire_lease("g", "two", Duration::from_secs(30))
            .is_err());
    }

    #[test]
    fn a_newer_store_is_refused_and_left_untouched() {
        let p = tmp();
        drop(Store::open(&p).unwrap());
        let c = Connection::open(&p).unwrap();
        c.execute(
            "UPDATE meta SET value = '99' WHERE key = 'schema_version'",
            [],
        )
        .unwrap();
        drop(c);
        let err = Store::open(&p).err().unwrap();
        assert!(
            err.to_string().contains("schema version 99, newer"),
            "{err}"
        );
        let c = Connection::open(&p).unwrap();
        let v: String = c
            .query_row(
                "SELECT value FROM meta WHERE key='schema_version'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(v, "99");
    }

    #[test]
    fn a_file_that_is_not_a_store_is_reported_and_kept() {
        let p = tmp();
        std::fs::write(&p, b"this is not sqlite at all, just some bytes...........................................................................").unwrap();
        let err = Store::open(&p).err().unwrap();
        assert!(
            err.to_string()
                .contains("not an lbscale store or is corrupt"),
            "{err}"
        );
        assert!(std::fs::read(&p)
            .unwrap()
            .starts_with(b"this is not sqlite"));
    }

    #[test]
    fn a_locked_store_gives_a_clear_error_and_loses_nothing() {
        let p = tmp();
        let s = Store::open_with_busy_timeout(&p, Duration::from_millis(200)).unwrap();
        s.record_event("g", None, "before", "kept").unwrap();
        let mut other = Connection::open(&p).unwrap();
        let tx = other
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .unwrap();
        let err = s
            .acquire_lease("g", "me", Duration::from_secs(5))
            .unwrap_err();
        assert!(matches!(err, StoreError::Locked(_)), "{err:?}");
        assert!(
            err.to_string().contains("locked by another process"),
            "{err}"
        );
        drop(tx);
        // Once the other writer is gone, the same call works and nothing was lost.
        s.acquire_lease("g", "me", Duration::from_secs(5)).unwrap();
        assert_eq!(s.events_of_group("g", 10).unwrap().len(), 1);
    }

    #[test]
    fn names_are_unique_per_kind() {
        let s = Store::open(&tmp()).unwrap();
        let spec = DistributorSpec {
            name: "d".into(),
            cloud: "local".into(),
            mode: "dns".into(),
            domain: None,
            ttl: "60s".into(),
        };
        s.insert_distributor("td-1", &spec).unwrap();
        let err = s.insert_distributor("td-2", &spec).unwrap_err();
        assert!(err.to_string().contains("already exists"), "{err}");
        assert_eq!(s.distributor_by_name("d").unwrap().unwrap().id, "td-1");
    }

    #[test]
    fn the_store_file_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let p = tmp();
        drop(Store::open(&p).unwrap());
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
}
