//! The store that the provider and the daemon share: a SQLite file by default,
//! or a PostgreSQL database for several daemons on several machines.
//!
//! - One set of queries for both databases, through the small SQL layer in
//!   [`crate::sqldb`], which holds every difference between the two.
//! - Versioned migrations: `meta.schema_version` says which ones ran; a store written
//!   by a newer lbscale is refused rather than misread.
//! - Several processes at once: short transactions; write transactions never
//!   overlap (SQLite: WAL and its write lock, with a busy timeout; PostgreSQL: one
//!   advisory lock per database, with a lock timeout). Two writers never act on
//!   one group at the same time: they hold the group's lease (`acquire_lease`),
//!   whose fencing token increases with every new holder.
//! - A SQLite file is created readable by its owner only: it holds the groups'
//!   secrets, from which their node API credentials derive (docs/security.md;
//!   with PostgreSQL, the database's own access control does).
//!   A PostgreSQL URL's password never appears in a message.

use crate::model::{DistributorSpec, GroupSpec, SeGroupSpec, VserverSpec};
use crate::sqldb::{
    redact_url, vals, Db, PgLimits, PgPool, PgTarget, SqlRow, SqliteDb, Value, NOW_MS,
};
use lbscale_core::policy::AzState;
use rusqlite::Connection;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod census;
mod events;
mod leases;
mod nodes;
mod schema;

pub use events::{Event, EventRetention, EVENTS_MAX_AGE_ENV, EVENTS_MAX_PER_GROUP_ENV};
pub use leases::{az_lease_key, daemon_claim_key, daemon_member_key, distributor_lease_key, Lease};
use leases::{fence_clause, live_lease};
use nodes::nodes_of_group_in;
pub use nodes::{NodeRow, NodeState, CONFIG_FENCE};
use schema::{INDEXES, MIGRATIONS};

/// The schema version this build writes. Each entry of `MIGRATIONS` moves the store
/// from version `i` to `i + 1`.
pub const SCHEMA_VERSION: i64 = 8;

/// Leases renewed by one statement of [`Store::renew_leases`].
pub const RENEW_BATCH: usize = 256;

/// How long a call waits for another process's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "the store URL {0:?} is not supported: use sqlite://PATH or postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE"
    )]
    UnsupportedUrl(String),
    /// `store`: the file's path, or the URL with its password masked.
    #[error("cannot open the store at {store}: {detail}")]
    Open { store: String, detail: String },
    #[error("the store at {store} is not an lbscale store or is corrupt ({detail}); it was left untouched")]
    Corrupt { store: String, detail: String },
    #[error("the store at {store} has schema version {found}, newer than this lbscale understands ({SCHEMA_VERSION}); upgrade lbscale. The store was left untouched")]
    TooNew { store: String, found: i64 },
    #[error("the store is locked by another process; gave up waiting for its lock after the busy timeout: {0}")]
    Locked(String),
    /// The database did not answer in time, or the connection failed: nothing
    /// is known to have been written by the call that failed.
    #[error("the store is unreachable: {0}")]
    Unreachable(String),
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
    /// A store setting (from the environment) that does not read; names it.
    #[error("{0}")]
    Setting(String),
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

/// The environment variable that gives the store's URL where the provider's
/// `state` or the CLI's `--state` is not given: it keeps a PostgreSQL password
/// out of `.tf` files and off the daemon's command line (which `ps` shows).
pub const STATE_URL_ENV: &str = "LBSCALE_STATE";

/// The store URL from [`STATE_URL_ENV`], when it is set and not blank.
pub fn state_url_from_env() -> Option<String> {
    std::env::var(STATE_URL_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty())
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

/// What [`Store::group_rows`] reads of a group.
#[derive(Debug, Clone)]
pub struct GroupRows {
    pub record: GroupRecord,
    pub nodes: Vec<NodeRow>,
    pub vservers: Vec<Row<VserverSpec>>,
    /// Read only behind an `nlb` distributor (None behind `dns`).
    pub nlb: Option<NlbRows>,
}

/// What placing a group's vservers over its nodes behind an `nlb` reads
/// besides the nodes and vservers ([`Store::nlb_rows`]).
#[derive(Debug, Clone, Default)]
pub struct NlbRows {
    pub se_groups: Vec<Row<SeGroupSpec>>,
    /// How many nodes hold each vserver in each AZ, by (vserver id, AZ), as
    /// last sized (absent: never).
    pub spans: BTreeMap<(String, String), u32>,
}

/// A group as one evaluation of the daemon reads it ([`Store::group_record`]).
#[derive(Debug, Clone)]
pub struct GroupRecord {
    pub row: Row<GroupSpec>,
    pub version: i64,
    /// Its destroy began (see migration 6 -> 7).
    pub deleting: bool,
    pub config_version: u64,
    /// Its distributor's spec (None: the distributor is gone).
    pub distributor: Option<DistributorSpec>,
    /// What the distributor's driver last confirmed it serves (the JSON of
    /// `reconcile::distributors`'s `Served`), if anything; read only when the
    /// group is the distributor's only one (what a distributor of many serves
    /// is as large as all their nodes, and no snapshot of one can use it).
    pub served: Option<String>,
    /// How many groups use the group's distributor, this one included.
    pub distributor_groups: i64,
    /// Who holds the group's own lease now, if anyone.
    pub lease_holder: Option<String>,
}

/// Where a store lives.
enum Backend {
    Sqlite(Mutex<Connection>),
    Postgres {
        /// Every call but the lease renewals.
        pool: Box<PgPool>,
        /// Lease renewals, releases and checks alone: a stalled query or a
        /// busy pool never delays the renewal that keeps a holder's work going.
        leases: Box<PgPool>,
    },
}

/// Every write transaction on PostgreSQL first takes this transaction-scoped
/// advisory lock (per database): writers are serialised as SQLite's write lock
/// serialises them, so the leases' read-then-write is exactly as on SQLite.
pub(crate) const PG_WRITE_LOCK: i64 = 0x6c62_7363_616c_6500; // "lbscale\0"

pub struct Store {
    backend: Backend,
    /// The file's path, or the URL with its password masked.
    location: String,
    /// Where drivers keep files on this machine (for `local`: runtime state).
    local_dir: PathBuf,
    path: Option<PathBuf>,
    /// Added to this host's clock where the store stamps a time of its own
    /// (events, rows' `created_at`): tests run a host whose clock is off. Lease
    /// times never use it: they are the database's.
    clock_offset_ms: AtomicI64,
    retention: Mutex<EventRetention>,
}

impl Store {
    /// Opens `sqlite://PATH` (a relative PATH is taken from `base_dir`) or
    /// `postgres://[user[:password]@]host[:port]/database[?options]` (also
    /// `postgresql://`); with PostgreSQL, drivers keep their local files under
    /// `base_dir/.lbscale`.
    pub fn open_url(url: &str, base_dir: &Path) -> Result<Store> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Store::open_postgres(url, base_dir, BUSY_TIMEOUT);
        }
        let Some(rest) = url.strip_prefix("sqlite://") else {
            return Err(StoreError::UnsupportedUrl(redact_url(url)));
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

    /// Opens a PostgreSQL store; a call waits at most `lock_wait` for another
    /// writer before failing with [`StoreError::Locked`].
    pub fn open_postgres(url: &str, base_dir: &Path, lock_wait: Duration) -> Result<Store> {
        let target = PgTarget::parse(url)?;
        let limits = PgLimits::new(lock_wait);
        // Lease statements are one row each: short deadlines, so that a
        // renewal that stalls is retried well within the lease's TTL.
        let lease_limits = PgLimits {
            lock_wait: Duration::from_secs(2),
            statement_timeout: Duration::from_secs(3),
            call_deadline: Duration::from_secs(4),
            max_connections: 2,
            ..limits
        };
        let store = Store {
            location: target.redacted().to_string(),
            backend: Backend::Postgres {
                pool: Box::new(PgPool::new(target.clone(), limits, "store")),
                leases: Box::new(PgPool::new(target, lease_limits, "lease")),
            },
            local_dir: base_dir.join(".lbscale"),
            path: None,
            clock_offset_ms: AtomicI64::new(0),
            retention: Mutex::new(EventRetention::from_env()?),
        };
        // The first connection says at once whether the server is there.
        store.with(|_| Ok(()))?;
        store.migrate()?;
        Ok(store)
    }

    pub fn open(path: &Path) -> Result<Store> {
        Store::open_with_busy_timeout(path, BUSY_TIMEOUT)
    }

    /// Opens the store; a call waits at most `busy_timeout` for another
    /// process's lock before failing with [`StoreError::Locked`].
    pub fn open_with_busy_timeout(path: &Path, busy_timeout: Duration) -> Result<Store> {
        let open_err = |detail: String| StoreError::Open {
            store: path.display().to_string(),
            detail,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| open_err(e.to_string()))?;
        }
        let existed = path.exists();
        let conn = Connection::open(path).map_err(|e| open_err(e.to_string()))?;
        if !existed {
            restrict_to_owner(path);
        }
        conn.busy_timeout(busy_timeout)?;
        let corrupt = |e: rusqlite::Error| StoreError::Corrupt {
            store: path.display().to_string(),
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
                store: path.display().to_string(),
                detail: m,
            },
            other => other,
        })?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(StoreError::from)?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(corrupt)?;
        let store = Store {
            location: path.display().to_string(),
            local_dir: path.parent().unwrap_or(Path::new(".")).to_path_buf(),
            path: Some(path.to_path_buf()),
            backend: Backend::Sqlite(Mutex::new(conn)),
            clock_offset_ms: AtomicI64::new(0),
            retention: Mutex::new(EventRetention::from_env()?),
        };
        store.migrate()?;
        Ok(store)
    }

    /// The SQLite file; `None` for PostgreSQL.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Where the store is, fit to print: the file's path, or the PostgreSQL URL
    /// with its password masked.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// The directory where drivers keep their files on this machine: next to a
    /// SQLite file, or `BASE_DIR/.lbscale` with PostgreSQL.
    pub fn local_dir(&self) -> &Path {
        &self.local_dir
    }

    /// Which database holds the store: `"sqlite"` or `"postgres"`.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite(_) => "sqlite",
            Backend::Postgres { .. } => "postgres",
        }
    }

    /// This host's clock as the store stamps times with (Unix ms).
    fn now(&self) -> i64 {
        now_ms() + self.clock_offset_ms.load(Ordering::Relaxed)
    }

    /// Test support: runs this handle as a host whose clock is `offset_ms` off.
    #[cfg(any(test, feature = "testing"))]
    pub fn set_clock_offset_for_tests(&self, offset_ms: i64) {
        self.clock_offset_ms.store(offset_ms, Ordering::Relaxed);
    }

    /// How long events are kept (see [`EventRetention`]).
    pub fn set_event_retention(&self, r: EventRetention) {
        *self.retention.lock().unwrap_or_else(|e| e.into_inner()) = r;
    }
    pub fn event_retention(&self) -> EventRetention {
        *self.retention.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Statements this process has sent to its stores (each one round trip on
    /// PostgreSQL), all stores together: the daemon exports it, benchmarks
    /// report it per interval.
    pub fn statements_sent() -> u64 {
        crate::sqldb::statements_sent()
    }

    /// Statements sent from the calling thread so far, by every store of the
    /// process: a test counts what a store call costs, its difference across
    /// the call, while other tests run on other threads.
    pub fn statements_sent_here() -> u64 {
        crate::sqldb::statements_sent_here()
    }

    /// Whether the store answers a trivial query within `deadline`, after
    /// waiting at most `deadline` for a free connection, or as long to open
    /// one; and no earlier call (a connect included) still waits past its
    /// deadline: the daemon's health probe.
    pub fn probe(&self, deadline: Duration) -> Result<()> {
        match &self.backend {
            Backend::Sqlite(_) => self.with(|c| c.int("SELECT 1", &[]).map(|_| ())),
            Backend::Postgres { pool, leases } => off_runtime(|| {
                let stalled = pool.stalled_calls() + leases.stalled_calls();
                if stalled > 0 {
                    return Err(StoreError::Unreachable(format!(
                        "{stalled} call(s) to PostgreSQL got no answer within their deadline and still wait for it"
                    )));
                }
                let mut c = pool.get_opening_within(deadline, deadline, deadline)?;
                c.int("SELECT 1", &[]).map(|_| ())
            }),
        }
    }

    fn migrate(&self) -> Result<()> {
        let location = self.location.clone();
        self.tx(|tx| {
            tx.batch(
                "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
            )?;
            let dialect = tx.dialect();
            let tables = tx.int(dialect.tables_sql(), &[])?;
            let version = tx
                .one("SELECT value FROM meta WHERE key = 'schema_version'", &[])?
                .map(|r| r.text(0))
                .transpose()?;
            let version: i64 = match version {
                Some(v) => v.parse().map_err(|_| StoreError::Corrupt {
                    store: location.clone(),
                    detail: format!("schema_version is {v:?}"),
                })?,
                None if tables > 0 => {
                    return Err(StoreError::Corrupt {
                        store: location.clone(),
                        detail: "it has tables but no lbscale schema version".into(),
                    })
                }
                None => 0,
            };
            if version > SCHEMA_VERSION {
                return Err(StoreError::TooNew {
                    store: location.clone(),
                    found: version,
                });
            }
            for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
                tx.batch(&dialect.ddl(sql))?;
                tx.execute(
                    "INSERT INTO meta (key, value) VALUES ('schema_version', ?1)
                     ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    vals![(i + 1).to_string()],
                )?;
            }
            // Within the migration's transaction: serialised with every
            // other process's (the write lock).
            tx.batch(INDEXES)?;
            Ok(())
        })
    }

    /// Runs `f` on a connection, each statement on its own (autocommit).
    fn with<T>(&self, f: impl FnOnce(&mut dyn Db) -> Result<T>) -> Result<T> {
        off_runtime(|| match &self.backend {
            Backend::Sqlite(c) => {
                let conn = c.lock().unwrap_or_else(|e| e.into_inner());
                f(&mut SqliteDb(&conn))
            }
            Backend::Postgres { pool, .. } => {
                let l = pool.limits();
                let mut conn = pool.get(l.call_deadline, l.call_deadline)?;
                f(&mut conn)
            }
        })
    }

    /// As [`Store::with`], for a caller on an async runtime: on PostgreSQL,
    /// the caller awaits a free connection and then `f`, which runs on that
    /// connection's thread, so that no worker thread of the runtime blocks
    /// and `f`'s statements are handed over once, not each. On SQLite (a
    /// local file) as [`Store::with`].
    async fn with_async<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Db) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        match &self.backend {
            Backend::Postgres { pool, .. } => {
                let mut conn = pool.get_async(pool.limits().call_deadline).await?;
                conn.run(f).await
            }
            Backend::Sqlite(_) => self.with(f),
        }
    }

    /// As [`Store::with`], on the connections kept for leases.
    fn with_leases<T>(&self, f: impl FnOnce(&mut dyn Db) -> Result<T>) -> Result<T> {
        match &self.backend {
            Backend::Sqlite(_) => self.with(f),
            Backend::Postgres { leases, .. } => off_runtime(|| {
                let l = leases.limits();
                let mut conn = leases.get(l.call_deadline, l.call_deadline)?;
                f(&mut conn)
            }),
        }
    }

    /// Runs `f` in a write transaction: committed if it returns Ok, rolled back
    /// otherwise. Write transactions do not overlap (SQLite: `BEGIN IMMEDIATE`;
    /// PostgreSQL: the store's advisory lock).
    fn tx<T>(&self, f: impl FnOnce(&mut dyn Db) -> Result<T>) -> Result<T> {
        off_runtime(|| self.tx_here(f))
    }

    fn tx_here<T>(&self, f: impl FnOnce(&mut dyn Db) -> Result<T>) -> Result<T> {
        match &self.backend {
            Backend::Sqlite(c) => {
                let mut conn = c.lock().unwrap_or_else(|e| e.into_inner());
                let tx =
                    conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                let out = f(&mut SqliteDb(&tx))?;
                tx.commit()?;
                Ok(out)
            }
            Backend::Postgres { pool, .. } => {
                let l = pool.limits();
                let mut conn = pool.get(l.call_deadline, l.call_deadline)?;
                pg_transaction(&mut conn, f)
            }
        }
    }

    /// As [`Store::tx`], for a caller on an async runtime (as
    /// [`Store::with_async`]): on PostgreSQL the whole transaction runs on
    /// the connection's thread, within one call deadline. Past that deadline
    /// the caller has heard an error and will write again: the thread then
    /// rolls back rather than commit a write its caller gave up on (only a
    /// COMMIT sent just before the deadline can still land after it).
    async fn tx_async<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Db) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        match &self.backend {
            Backend::Postgres { pool, .. } => {
                let mut conn = pool.get_async(pool.limits().call_deadline).await?;
                let until = Instant::now() + pool.limits().call_deadline;
                conn.run(move |db| {
                    pg_transaction(db, |db| {
                        let out = f(db)?;
                        if Instant::now() >= until {
                            return Err(StoreError::Unreachable(
                                "the transaction outlasted its call deadline; rolled back".into(),
                            ));
                        }
                        Ok(out)
                    })
                })
                .await
            }
            Backend::Sqlite(_) => self.tx(f),
        }
    }

    // --- declared objects -------------------------------------------------------

    fn insert_named(
        &self,
        kind: &'static str,
        sql: &str,
        name: &str,
        params: &[Value],
    ) -> Result<()> {
        let table = table_of(kind);
        self.tx(|tx| {
            let taken = tx.one(
                &format!("SELECT id FROM {table} WHERE name = ?1"),
                vals![name],
            )?;
            if let Some(existing) = taken {
                return Err(StoreError::NameTaken {
                    kind,
                    name: name.to_string(),
                    id: existing.text(0)?,
                });
            }
            tx.execute(sql, params)?;
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
            let taken = tx.one(
                &format!("SELECT id FROM {table} WHERE name = ?1 AND id != ?2"),
                vals![name, id],
            )?;
            if let Some(existing) = taken {
                return Err(StoreError::NameTaken {
                    kind,
                    name: name.to_string(),
                    id: existing.text(0)?,
                });
            }
            tx.execute(
                &format!(
                    "UPDATE {table} SET name = ?2, {parent_col} = ?3, spec = ?4 WHERE id = ?1"
                ),
                vals![id, name, parent, spec],
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
        let row = self.with(|c| {
            c.one(
                &format!("SELECT id, spec FROM {table} WHERE {column} = ?1"),
                vals![value],
            )
        })?;
        row.map(|r| {
            let spec = decode(kind, &r.text(1)?)?;
            Ok(Row {
                id: r.text(0)?,
                spec,
            })
        })
        .transpose()
    }

    fn rows_of<T: DeserializeOwned>(kind: &'static str, rows: Vec<SqlRow>) -> Result<Vec<Row<T>>> {
        rows.into_iter()
            .map(|r| {
                let spec = decode(kind, &r.text(1)?)?;
                Ok(Row {
                    id: r.text(0)?,
                    spec,
                })
            })
            .collect()
    }

    fn list_by<T: DeserializeOwned>(
        &self,
        kind: &'static str,
        column: &str,
        value: &str,
    ) -> Result<Vec<Row<T>>> {
        self.with(|c| list_by_in(c, kind, column, value))
    }

    fn delete_row(&self, kind: &'static str, id: &str) -> Result<()> {
        let table = table_of(kind);
        self.with(|c| c.execute(&format!("DELETE FROM {table} WHERE id = ?1"), vals![id]))?;
        Ok(())
    }

    pub fn insert_distributor(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        let json = serde_json::to_string(spec).expect("specs serialise");
        self.insert_named(
            "traffic distributor",
            "INSERT INTO distributors (id, name, spec, created_at) VALUES (?1, ?2, ?3, ?4)",
            &spec.name,
            vals![id, &spec.name, json, self.now()],
        )
    }
    pub fn update_distributor(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        let s = serde_json::to_string(spec).expect("specs serialise");
        self.with(|c| {
            c.execute(
                "UPDATE distributors SET spec = ?2 WHERE id = ?1",
                vals![id, s],
            )?;
            // Its groups' policy reads the distributor's mode and TTL.
            c.execute(
                "UPDATE groups SET version = version + 1 WHERE distributor_id = ?1",
                vals![id],
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
    /// Deletes the distributor and its publication lease.
    pub fn delete_distributor(&self, id: &str) -> Result<()> {
        let lease = distributor_lease_key(id);
        self.tx(|tx| {
            tx.execute("DELETE FROM leases WHERE group_id = ?1", vals![&lease])?;
            tx.execute("DELETE FROM distributors WHERE id = ?1", vals![id])?;
            Ok(())
        })
    }
    /// Driver state of a distributor (for `local`: process, addresses, config version).
    pub fn distributor_runtime(&self, id: &str) -> Result<serde_json::Value> {
        let s =
            self.with(|c| c.one("SELECT runtime FROM distributors WHERE id = ?1", vals![id]))?;
        s.map_or(Ok(serde_json::Value::Null), |s| {
            decode("distributor runtime", &s.text(0)?)
        })
    }
    /// The distributor with what its driver last confirmed it serves (see
    /// [`Store::served_publication`]), in one statement.
    pub fn distributor_and_served(
        &self,
        id: &str,
    ) -> Result<Option<(Row<DistributorSpec>, Option<String>)>> {
        let row = self.with(|c| {
            c.one(
                "SELECT id, spec, served FROM distributors WHERE id = ?1",
                vals![id],
            )
        })?;
        row.map(|r| {
            Ok((
                Row {
                    id: r.text(0)?,
                    spec: decode("traffic distributor", &r.text(1)?)?,
                },
                r.opt_text(2)?,
            ))
        })
        .transpose()
    }
    /// What the distributor's driver last confirmed it serves (see
    /// `reconcile::distributors`); `None` when nothing was confirmed yet.
    pub fn served_publication(&self, id: &str) -> Result<Option<String>> {
        let row =
            self.with(|c| c.one("SELECT served FROM distributors WHERE id = ?1", vals![id]))?;
        row.map_or(Ok(None), |r| r.opt_text(0))
    }
    /// Records what distributor `id` serves, fenced by `lease` (the
    /// distributor's) in the statement itself.
    pub fn set_served_publication_under(
        &self,
        lease: &Lease,
        id: &str,
        served: &str,
    ) -> Result<()> {
        let written = self.with(|c| {
            c.execute(
                &format!(
                    "UPDATE distributors SET served = ?2 WHERE id = ?1 AND {}",
                    fence_clause(3)
                ),
                vals![id, served, &lease.group_id, &lease.holder, lease.fence],
            )
        })?;
        if written > 0 || self.distributor(id)?.is_none() {
            return Ok(());
        }
        self.fenced(lease, 0, "what the distributor serves not recorded")
    }
    pub fn set_distributor_runtime(&self, id: &str, runtime: &serde_json::Value) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE distributors SET runtime = ?2 WHERE id = ?1",
                vals![id, runtime.to_string()],
            )
        })?;
        Ok(())
    }

    /// Inserts the group with its node API token in one transaction: a group
    /// row is never without its token.
    pub fn insert_group(&self, id: &str, spec: &GroupSpec, token: &str) -> Result<()> {
        if token.is_empty() {
            return Err(StoreError::Sql(format!(
                "autoscale group {:?} not inserted: its node API token is empty",
                spec.name
            )));
        }
        let json = serde_json::to_string(spec).expect("specs serialise");
        let now = self.now();
        self.tx(|tx| {
            let taken = tx.one("SELECT id FROM groups WHERE name = ?1", vals![&spec.name])?;
            if let Some(existing) = taken {
                return Err(StoreError::NameTaken {
                    kind: "autoscale group",
                    name: spec.name.clone(),
                    id: existing.text(0)?,
                });
            }
            tx.execute(
                "INSERT INTO groups (id, name, distributor_id, spec, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
                vals![id, &spec.name, &spec.traffic_distributor_id, json, now],
            )?;
            tx.execute(
                "INSERT INTO group_secrets (group_id, token) VALUES (?1, ?2)",
                vals![id, token],
            )?;
            Ok(())
        })
    }
    /// Updates the group; the spans of its vservers in AZs it no longer has go.
    pub fn update_group(&self, id: &str, spec: &GroupSpec) -> Result<()> {
        self.update_named(
            "autoscale group",
            id,
            &spec.name,
            &spec.traffic_distributor_id,
            spec,
        )?;
        self.with(|c| {
            c.execute(
                "UPDATE groups SET version = version + 1 WHERE id = ?1",
                vals![id],
            )
        })?;
        let spans: Vec<(String, String)> = self.with(|c| {
            c.query(
                "SELECT sp.vserver_id, sp.az FROM vserver_spans sp
                 JOIN vservers v ON v.id = sp.vserver_id
                 JOIN se_groups s ON s.id = v.se_group_id
                 WHERE s.group_id = ?1",
                vals![id],
            )?
            .iter()
            .map(|r| Ok((r.text(0)?, r.text(1)?)))
            .collect()
        })?;
        for (vserver, az) in spans {
            if !spec.availability_zones.contains(&az) {
                self.with(|c| {
                    c.execute(
                        "DELETE FROM vserver_spans WHERE vserver_id = ?1 AND az = ?2",
                        vals![&vserver, &az],
                    )
                })?;
            }
        }
        Ok(())
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
        let rows =
            self.with(|c| c.query("SELECT id, spec FROM groups ORDER BY created_at, id", &[]))?;
        Self::rows_of("autoscale group", rows)
    }
    /// Every group's id and row version (raised by every change of its spec or
    /// its distributor's), oldest group first: what the daemon reads at every
    /// tick, without decoding a spec.
    pub fn group_versions(&self) -> Result<Vec<(String, i64)>> {
        self.with(|c| {
            c.query(
                "SELECT id, version FROM groups ORDER BY created_at, id",
                &[],
            )?
            .iter()
            .map(|r| Ok((r.text(0)?, r.int(1)?)))
            .collect()
        })
    }
    /// What changes whenever a group is added, removed or gets a new row
    /// version: the groups' count, the sum of their versions and the newest
    /// one's `created_at`. One row, whatever the number of groups: the daemon
    /// reads it each tick and lists the versions ([`Store::group_versions`])
    /// only when it changed.
    pub async fn groups_fingerprint(&self) -> Result<(i64, i64, i64)> {
        self.with_async(|c| {
            let r = c.one(
                "SELECT count(*), CAST(coalesce(sum(version), 0) AS BIGINT), coalesce(max(created_at), 0)
                 FROM groups",
                &[],
            )?;
            match r {
                Some(r) => Ok((r.int(0)?, r.int(1)?, r.int(2)?)),
                None => Ok((0, 0, 0)),
            }
        })
        .await
    }
    /// The group with its row version, read together.
    pub fn group_with_version(&self, id: &str) -> Result<Option<(Row<GroupSpec>, i64)>> {
        let row = self.with(|c| {
            c.one(
                "SELECT id, spec, version FROM groups WHERE id = ?1",
                vals![id],
            )
        })?;
        row.map(|r| {
            let spec = decode("autoscale group", &r.text(1)?)?;
            Ok((
                Row {
                    id: r.text(0)?,
                    spec,
                },
                r.int(2)?,
            ))
        })
        .transpose()
    }
    /// What the daemon reads of a group at each evaluation, in one statement:
    /// its row (spec, version, whether its destroy began, its configuration
    /// version), its distributor's spec, and who holds the group's own lease
    /// now (unexpired by the database's clock).
    pub fn group_record(&self, id: &str) -> Result<Option<GroupRecord>> {
        self.with(|c| group_record_in(c, id))
    }

    /// The group's record, its nodes and its vservers (and behind an `nlb`
    /// its [`NlbRows`]), as one evaluation of the daemon reads them: three
    /// statements (five behind an `nlb`), handed to the store's
    /// connection together without blocking the caller ([`Store::with_async`]).
    /// `None` when the group is gone.
    pub async fn group_rows(&self, id: &str) -> Result<Option<GroupRows>> {
        let id = id.to_string();
        self.with_async(move |c| {
            let Some(record) = group_record_in(c, &id)? else {
                return Ok(None);
            };
            let behind_nlb = record
                .distributor
                .as_ref()
                .is_some_and(|d| d.mode == crate::model::DistributorMode::Nlb);
            Ok(Some(GroupRows {
                record,
                nodes: nodes_of_group_in(c, &id)?,
                vservers: vservers_of_group_in(c, &id)?,
                nlb: behind_nlb.then(|| nlb_rows_in(c, &id)).transpose()?,
            }))
        })
        .await
    }

    /// The group's secret: its CA and every node's token derive from it
    /// (`nodeapi::auth`). Sensitive: never log or print it.
    pub fn group_token(&self, group_id: &str) -> Result<Option<String>> {
        self.with(|c| {
            c.one(
                "SELECT token FROM group_secrets WHERE group_id = ?1",
                vals![group_id],
            )?
            .map(|r| r.text(0))
            .transpose()
        })
    }
    /// Bumps the version of the configuration that the group's nodes must run.
    pub fn bump_config_version(&self, group_id: &str) -> Result<u64> {
        self.tx(|c| {
            c.execute(
                "UPDATE groups SET config_version = config_version + 1 WHERE id = ?1",
                vals![group_id],
            )?;
            c.int(
                "SELECT config_version FROM groups WHERE id = ?1",
                vals![group_id],
            )
        })
        .map(|v| v as u64)
    }
    /// The next fence of the configurations pushed to group `group_id`'s
    /// nodes, taken under `lease` in the statement itself (a holder that lost
    /// its lease gets none: [`StoreError::LeaseLost`]). Take it before reading
    /// what the configuration holds: a configuration with a higher fence was
    /// read after every write made under a lower one, so a node that keeps the
    /// highest fence it applied never goes back to an older configuration. At
    /// least the database's clock in ms, so that a store restored from a
    /// backup still moves past what its nodes have seen.
    pub fn next_config_fence(&self, group_id: &str, lease: &Lease) -> Result<u64> {
        let next = self.with(|c| {
            c.one(
                &format!(
                    "UPDATE groups SET config_fence = CASE WHEN config_fence + 1 > {NOW_MS}
                       THEN config_fence + 1 ELSE {NOW_MS} END
                     WHERE id = ?1 AND {} RETURNING config_fence",
                    fence_clause(2)
                ),
                vals![group_id, &lease.group_id, &lease.holder, lease.fence],
            )?
            .map(|r| r.int(0))
            .transpose()
        })?;
        match next {
            Some(f) => Ok(f as u64),
            None => {
                // No row written: the lease is lost, or the group is gone.
                self.check_lease(lease)?;
                Err(StoreError::GroupGone(group_id.to_string()))
            }
        }
    }
    pub fn config_version(&self, group_id: &str) -> Result<u64> {
        self.with(|c| {
            c.one(
                "SELECT config_version FROM groups WHERE id = ?1",
                vals![group_id],
            )?
            .map(|r| r.int(0))
            .transpose()
        })
        .map(|v| v.unwrap_or(0) as u64)
    }
    /// Marks the group as being destroyed (see migration 6 -> 7).
    pub fn mark_group_deleting(&self, id: &str) -> Result<()> {
        self.with(|c| c.execute("UPDATE groups SET deleting = 1 WHERE id = ?1", vals![id]))?;
        Ok(())
    }
    /// Whether the group's destroy began and has not finished.
    pub fn group_deleting(&self, id: &str) -> Result<bool> {
        let row = self.with(|c| c.one("SELECT deleting FROM groups WHERE id = ?1", vals![id]))?;
        row.map_or(Ok(false), |r| Ok(r.int(0)? != 0))
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
                tx.execute(sql, vals![id])?;
            }
            tx.execute("DELETE FROM leases WHERE group_id = ?1", vals![&claim])?;
            tx.execute(
                "DELETE FROM leases WHERE group_id LIKE ?1",
                vals![az_lease_key(id, "%")],
            )?;
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
    /// On PostgreSQL it waits on the runtime, holding no thread of it
    /// ([`Store::tx_async`]): the daemon writes it at each evaluation of a
    /// breach streak.
    pub async fn put_policy_state(
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
        let now = self.now();
        let (claim, group_id, az) = (claim.clone(), group_id.to_string(), az.to_string());
        let key = claim.group_id.clone();
        let lost = move |detail: String| {
            Err(StoreError::LeaseLost {
                group: key.clone(),
                detail,
            })
        };
        self.tx_async(move |tx| {
            // Fenced in the statement: written only where the claim is this
            // holder's with this fence, unexpired by the database's clock, the
            // group still there, and no newer claim wrote the row.
            let written = tx.execute(
                &format!(
                    "INSERT INTO policy_state (group_id, az, state, holder, fence, updated_at)
                     SELECT ?1, ?2, ?3, ?4, CAST(?5 AS BIGINT), CAST(?6 AS BIGINT)
                     WHERE EXISTS (SELECT 1 FROM leases WHERE group_id = ?7 AND holder = ?4
                                   AND fence = ?5 AND expires_ms > {NOW_MS})
                       AND EXISTS (SELECT 1 FROM groups WHERE id = ?1)
                     ON CONFLICT (group_id, az) DO UPDATE SET state = excluded.state,
                       holder = excluded.holder, fence = excluded.fence, updated_at = excluded.updated_at
                     WHERE policy_state.fence <= excluded.fence"
                ),
                vals![&group_id, &az, json, &claim.holder, claim.fence, now, &claim.group_id],
            )?;
            if written == 1 {
                return Ok(());
            }
            // Not written: say why.
            match live_lease(tx, &claim.group_id)? {
                Some((h, _)) if h == claim.holder => {}
                Some((h, _)) => {
                    return lost(format!(
                        "policy state not written: {h} holds the claim (ours had fence {})",
                        claim.fence
                    ))
                }
                None => return lost("policy state not written: the claim expired or is gone".into()),
            }
            // A group that is gone under a live claim is no error: its deletion
            // removed its rows, and a late writer must not bring one back.
            if tx.int("SELECT count(*) FROM groups WHERE id = ?1", vals![&group_id])? == 0 {
                return Ok(());
            }
            let stored = tx
                .one(
                    "SELECT fence FROM policy_state WHERE group_id = ?1 AND az = ?2",
                    vals![&group_id, &az],
                )?
                .map(|r| r.int(0))
                .transpose()?;
            lost(match stored {
                Some(f) if f > claim.fence => format!(
                    "policy state not written: a newer claim (fence {f}) wrote it, ours is {}",
                    claim.fence
                ),
                _ => format!(
                    "policy state not written: the claim's fence is no longer {}",
                    claim.fence
                ),
            })
        })
        .await
    }

    /// The group's persisted policy state, one row per AZ (by AZ name).
    pub fn policy_states(&self, group_id: &str) -> Result<Vec<PolicyStateRow>> {
        let rows = self.with(|c| {
            c.query(
                "SELECT az, state, holder, fence, updated_at FROM policy_state
                 WHERE group_id = ?1 ORDER BY az",
                vals![group_id],
            )
        })?;
        rows.into_iter()
            .map(|r| {
                Ok(PolicyStateRow {
                    group_id: group_id.to_string(),
                    az: r.text(0)?,
                    state: decode("policy state", &r.text(1)?)?,
                    holder: r.text(2)?,
                    fence: r.int(3)?,
                    updated_at: r.int(4)?,
                })
            })
            .collect()
    }

    pub fn insert_se_group(&self, id: &str, spec: &SeGroupSpec) -> Result<()> {
        let json = serde_json::to_string(spec).expect("specs serialise");
        self.insert_named(
            "SE group",
            "INSERT INTO se_groups (id, name, group_id, spec, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
            &spec.name,
            vals![id, &spec.name, &spec.autoscale_group_id, json, self.now()],
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
        let json = serde_json::to_string(spec).expect("specs serialise");
        self.insert_named(
            "vserver",
            "INSERT INTO vservers (id, name, se_group_id, spec, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
            &spec.name,
            vals![id, &spec.name, &spec.se_group_id, json, self.now()],
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
    /// Deletes the vserver and the spans chosen for it.
    pub fn delete_vserver(&self, id: &str) -> Result<()> {
        self.tx(|tx| {
            tx.execute("DELETE FROM vserver_spans WHERE vserver_id = ?1", vals![id])?;
            tx.execute("DELETE FROM vservers WHERE id = ?1", vals![id])?;
            Ok(())
        })
    }
    /// How many nodes of `az` hold the vserver, as last sized (None: never).
    pub fn vserver_span(&self, vserver_id: &str, az: &str) -> Result<Option<u32>> {
        self.with(|c| {
            c.one(
                "SELECT span FROM vserver_spans WHERE vserver_id = ?1 AND az = ?2",
                vals![vserver_id, az],
            )?
            .map(|r| r.int(0))
            .transpose()
        })
        .map(|v| v.map(stored_span))
    }
    /// The group's SE groups and its vservers' spans, for placing them
    /// behind an `nlb`.
    pub fn nlb_rows(&self, group_id: &str) -> Result<NlbRows> {
        self.with(|c| nlb_rows_in(c, group_id))
    }
    /// Records the span; nothing for a vserver that is gone (deleted since the
    /// caller looked), so that no row outlives it. With `claim` (the daemon's
    /// claim on the group), refused with [`StoreError::LeaseLost`] unless it is
    /// the current, unexpired claim (by the database's clock): a daemon that
    /// lost the group does not size its vservers. The fence is in the write's
    /// own statement.
    pub fn set_vserver_span(
        &self,
        vserver_id: &str,
        az: &str,
        span: u32,
        claim: Option<&Lease>,
    ) -> Result<()> {
        self.tx(|tx| {
            let (key, holder, fence) = match claim {
                Some(c) => (
                    Some(c.group_id.as_str()),
                    Some(c.holder.as_str()),
                    Some(c.fence),
                ),
                None => (None, None, None),
            };
            let written = tx.execute(
                &format!(
                    "INSERT INTO vserver_spans (vserver_id, az, span)
                     SELECT ?1, ?2, CAST(?3 AS BIGINT)
                     WHERE EXISTS (SELECT 1 FROM vservers WHERE id = ?1)
                       AND (CAST(?4 AS TEXT) IS NULL OR EXISTS (
                         SELECT 1 FROM leases WHERE group_id = ?4 AND holder = ?5
                           AND fence = CAST(?6 AS BIGINT) AND expires_ms > {NOW_MS}))
                     ON CONFLICT (vserver_id, az) DO UPDATE SET span = excluded.span"
                ),
                vals![vserver_id, az, i64::from(span), key, holder, fence],
            )?;
            if written == 0 {
                if let Some(claim) = claim {
                    let vserver_there =
                        tx.one("SELECT 1 FROM vservers WHERE id = ?1", vals![vserver_id])?;
                    if vserver_there.is_some() {
                        return Err(StoreError::LeaseLost {
                            group: claim.group_id.clone(),
                            detail: format!(
                                "span not written: the claim (fence {}) is no longer this daemon's",
                                claim.fence
                            ),
                        });
                    }
                }
            }
            Ok(())
        })
    }
    /// Every vserver placed on the group, through its SE groups.
    pub fn vservers_of_group(&self, group_id: &str) -> Result<Vec<Row<VserverSpec>>> {
        self.with(|c| vservers_of_group_in(c, group_id))
    }
}

/// The group's row, its distributor and its lease holder: one statement.
fn group_record_in(c: &mut dyn Db, id: &str) -> Result<Option<GroupRecord>> {
    let row = c.one(
        &format!(
            "SELECT g.id, g.spec, g.version, g.deleting, g.config_version, d.spec,
               (SELECT holder FROM leases WHERE group_id = g.id AND expires_ms > {NOW_MS}),
               CASE WHEN (SELECT count(*) FROM groups o WHERE o.distributor_id = g.distributor_id) = 1
                 THEN d.served END,
               (SELECT count(*) FROM groups o WHERE o.distributor_id = g.distributor_id)
             FROM groups g LEFT JOIN distributors d ON d.id = g.distributor_id
             WHERE g.id = ?1"
        ),
        vals![id],
    )?;
    row.map(|r| {
        Ok(GroupRecord {
            row: Row {
                id: r.text(0)?,
                spec: decode("autoscale group", &r.text(1)?)?,
            },
            version: r.int(2)?,
            deleting: r.int(3)? != 0,
            config_version: r.int(4)?.max(0) as u64,
            distributor: r
                .opt_text(5)?
                .map(|s| decode("traffic distributor", &s))
                .transpose()?,
            lease_holder: r.opt_text(6)?,
            served: r.opt_text(7)?,
            distributor_groups: r.int(8)?,
        })
    })
    .transpose()
}

/// The vservers of the group's SE groups, SE group by SE group, each in
/// its order of creation: one statement, however many SE groups.
fn vservers_of_group_in(c: &mut dyn Db, group_id: &str) -> Result<Vec<Row<VserverSpec>>> {
    let rows = c.query(
        "SELECT v.id, v.spec FROM vservers v JOIN se_groups s ON s.id = v.se_group_id
         WHERE s.group_id = ?1 ORDER BY s.created_at, s.id, v.created_at, v.id",
        vals![group_id],
    )?;
    Store::rows_of("vserver", rows)
}

/// `f` in a write transaction of PostgreSQL connection `db`, under the
/// store's write lock: committed if it returns Ok, rolled back otherwise.
/// Through a pooled connection ([`Store::tx`]), one that stalled is dropped,
/// not rolled back (its ROLLBACK fails at once): its server ends the
/// transaction (idle_in_transaction_session_timeout, or the socket closing
/// when the stalled call returns).
fn pg_transaction<T>(db: &mut dyn Db, f: impl FnOnce(&mut dyn Db) -> Result<T>) -> Result<T> {
    let rollback = |db: &mut dyn Db| {
        let _ = db.batch("ROLLBACK");
    };
    db.batch(&format!(
        "BEGIN; SELECT pg_advisory_xact_lock({PG_WRITE_LOCK})"
    ))
    .inspect_err(|_| rollback(db))?;
    let out = f(db).and_then(|out| db.batch("COMMIT").map(|()| out));
    out.inspect_err(|_| rollback(db))
}

/// A stored span as a node count (a row can never make it 0 or negative).
fn stored_span(span: i64) -> u32 {
    span.clamp(1, i64::from(u32::MAX)) as u32
}

/// [`Store::list_by`] on connection `c`.
fn list_by_in<T: DeserializeOwned>(
    c: &mut dyn Db,
    kind: &'static str,
    column: &str,
    value: &str,
) -> Result<Vec<Row<T>>> {
    let table = table_of(kind);
    let rows = c.query(
        &format!("SELECT id, spec FROM {table} WHERE {column} = ?1 ORDER BY created_at, id"),
        vals![value],
    )?;
    Store::rows_of(kind, rows)
}

fn nlb_rows_in(c: &mut dyn Db, group_id: &str) -> Result<NlbRows> {
    let se_groups = list_by_in(c, "SE group", "group_id", group_id)?;
    let spans = c.query(
        "SELECT p.vserver_id, p.az, p.span FROM vserver_spans p
         JOIN vservers v ON v.id = p.vserver_id JOIN se_groups s ON s.id = v.se_group_id
         WHERE s.group_id = ?1",
        vals![group_id],
    )?;
    Ok(NlbRows {
        se_groups,
        spans: spans
            .iter()
            .map(|r| Ok(((r.text(0)?, r.text(1)?), stored_span(r.int(2)?))))
            .collect::<Result<_>>()?,
    })
}

/// Runs a blocking store call where it does not hold up the async tasks of
/// the runtime it is called from: on a multi-threaded Tokio runtime, the
/// worker thread hands its tasks to another first (`block_in_place`).
/// Elsewhere (no runtime, a current-thread runtime, which cannot do that) it
/// runs as it is.
fn off_runtime<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
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
    use crate::store_test;
    use crate::store_testing::{Kind, TestStore};

    fn tmp() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "lbscale-store-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d.join("state.db")
    }

    store_test!(lease_excludes_a_second_holder_and_fences_the_next, |ts| {
        let s = ts.open();
        let a = s
            .acquire_lease("distributor/g1", "a", Duration::from_secs(30))
            .unwrap();
        assert!(matches!(
            s.acquire_lease("distributor/g1", "b", Duration::from_secs(30)),
            Err(StoreError::LeaseHeld { .. })
        ));
        // Re-acquiring our own lease keeps the token.
        assert_eq!(
            s.acquire_lease("distributor/g1", "a", Duration::from_secs(30))
                .unwrap()
                .fence,
            a.fence
        );
        s.release_lease(&a).unwrap();
        let b = s
            .acquire_lease("distributor/g1", "b", Duration::from_secs(30))
            .unwrap();
        assert!(b.fence > a.fence);
    });

    store_test!(
        a_renewed_lease_is_checked_and_a_taken_over_one_is_lost,
        |ts| {
            let s = ts.open();
            // Long enough not to run out between the calls on a loaded host.
            let a = s
                .acquire_lease("distributor/g1", "a", Duration::from_secs(5))
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
            let b = s
                .acquire_lease("distributor/g1", "b", Duration::from_secs(30))
                .unwrap();
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
    );

    // Two handles on one store are two daemons (two processes, two connections).
    store_test!(lease_is_shared_across_processes_through_the_store, |ts| {
        let s1 = ts.open();
        let s2 = ts.open();
        // Long enough that it is still held at s2's try on a loaded host.
        let one = s1
            .acquire_lease("distributor/g", "one", Duration::from_secs(1))
            .unwrap();
        assert!(matches!(
            s2.acquire_lease("distributor/g", "two", Duration::from_secs(30)),
            Err(StoreError::LeaseHeld { .. })
        ));
        std::thread::sleep(Duration::from_millis(1100));
        // Expired: the other handle takes it over with a higher fence, and the
        // first one's fence check fails from then on.
        let two = s2
            .acquire_lease("distributor/g", "two", Duration::from_secs(30))
            .unwrap();
        assert!(two.fence > one.fence);
        assert!(matches!(
            s1.check_lease(&one),
            Err(StoreError::LeaseLost { .. })
        ));
        assert!(matches!(
            s1.renew_lease(&one, Duration::from_secs(30)),
            Err(StoreError::LeaseLost { .. })
        ));
        s1.check_lease(&two).unwrap();
    });

    // Many handles race for one free lease: exactly one wins each round, and
    // a new winner's fence is higher than every fence before it (a holder that
    // takes its own released lease back keeps its fence).
    store_test!(racing_handles_get_exactly_one_lease_per_round, |ts| {
        let stores: Vec<std::sync::Arc<Store>> =
            (0..4).map(|_| std::sync::Arc::new(ts.open())).collect();
        let mut last: Option<Lease> = None;
        for round in 0..8 {
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(stores.len()));
            let handles: Vec<_> = stores
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let s = s.clone();
                    let b = barrier.clone();
                    std::thread::spawn(move || {
                        b.wait();
                        s.acquire_lease("distributor/g", &format!("d{i}"), Duration::from_secs(30))
                    })
                })
                .collect();
            let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            let won: Vec<&Lease> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
            assert_eq!(won.len(), 1, "round {round}: {results:?}");
            for r in &results {
                if let Err(e) = r {
                    assert!(matches!(e, StoreError::LeaseHeld { .. }), "{e:?}");
                }
            }
            match &last {
                Some(l) if l.holder == won[0].holder => assert_eq!(won[0].fence, l.fence),
                Some(l) => assert!(won[0].fence > l.fence, "round {round}"),
                None => assert_eq!(won[0].fence, 1),
            }
            last = Some(won[0].clone());
            stores[0].release_lease(won[0]).unwrap();
        }
    });

    store_test!(a_newer_store_is_refused_and_left_untouched, |ts| {
        drop(ts.open());
        ts.raw("UPDATE meta SET value = '99' WHERE key = 'schema_version'");
        let err = ts.try_open().err().unwrap();
        assert!(
            matches!(err, StoreError::TooNew { found: 99, .. }),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("schema version 99, newer"),
            "{err}"
        );
        assert_eq!(
            ts.raw_text("SELECT value FROM meta WHERE key='schema_version'")
                .as_deref(),
            Some("99")
        );
    });

    store_test!(a_store_with_foreign_tables_is_refused, |ts| {
        ts.raw("CREATE TABLE someone_elses (x INTEGER)");
        let err = ts.try_open().err().unwrap();
        assert!(
            err.to_string()
                .contains("it has tables but no lbscale schema version"),
            "{err}"
        );
    });

    store_test!(a_locked_store_gives_a_clear_error_and_loses_nothing, |ts| {
        let s = match ts.kind {
            Kind::Sqlite => {
                Store::open_with_busy_timeout(&ts.dir.join("state.db"), Duration::from_millis(200))
                    .unwrap()
            }
            Kind::Postgres => {
                Store::open_postgres(&ts.url, &ts.dir, Duration::from_millis(200)).unwrap()
            }
        };
        s.record_event("g", None, "before", "kept").unwrap();
        let lock = ts.hold_write_lock();
        let err = s
            .acquire_lease("distributor/g", "me", Duration::from_secs(5))
            .unwrap_err();
        assert!(matches!(err, StoreError::Locked(_)), "{err:?}");
        assert!(
            err.to_string().contains("locked by another process"),
            "{err}"
        );
        drop(lock);
        // Once the other writer is gone, the same call works and nothing was lost.
        s.acquire_lease("distributor/g", "me", Duration::from_secs(5))
            .unwrap();
        assert_eq!(s.events_of_group("g", 10).unwrap().len(), 1);
    });

    store_test!(names_are_unique_per_kind, |ts| {
        use crate::model::{CloudName, DeclaredDuration, DistributorMode};
        let s = ts.open();
        let spec = DistributorSpec {
            name: "d".into(),
            cloud: CloudName::Local,
            mode: DistributorMode::Dns,
            domain: None,
            ttl: DeclaredDuration::parse("60s").unwrap(),
        };
        s.insert_distributor("td-1", &spec).unwrap();
        let err = s.insert_distributor("td-2", &spec).unwrap_err();
        assert!(err.to_string().contains("already exists"), "{err}");
        assert_eq!(s.distributor_by_name("d").unwrap().unwrap().id, "td-1");
        assert_eq!(s.count_rows("distributors").unwrap(), 1);
    });

    store_test!(nodes_events_and_addresses_round_trip, |ts| {
        let s = ts.open();
        let n = NodeRow {
            id: "n1".into(),
            group_id: "g".into(),
            az: "az1".into(),
            seq: s.next_node_seq("g").unwrap(),
            state: NodeState::Joining,
            private_ip: "127.0.0.2".into(),
            public_ip: None,
            registered: false,
            handle: serde_json::json!({"pid": 7}),
            created_at: 5,
        };
        s.insert_node(&n).unwrap();
        assert_eq!(s.next_node_seq("g").unwrap(), 2);
        let mut m = n.clone();
        m.state = NodeState::Active;
        m.registered = true;
        m.public_ip = Some("1.2.3.4".into());
        s.update_node(&m).unwrap();
        assert_eq!(s.nodes_of_group("g").unwrap(), vec![m]);
        for i in 0..5 {
            s.record_event("g", (i % 2 == 0).then_some("az1"), "k", &format!("r{i}"))
                .unwrap();
        }
        let ev = s.events_of_group("g", 3).unwrap();
        let reasons: Vec<_> = ev.iter().map(|e| e.reason.as_str()).collect();
        assert_eq!(reasons, ["r2", "r3", "r4"]);
        assert_eq!(ev[0].az.as_deref(), Some("az1"));
        assert_eq!(ev[1].az, None);
        let cands = || ["127.0.0.5", "127.0.0.6"].into_iter().map(String::from);
        assert_eq!(
            s.reserve_address("o1", cands(), |_| true)
                .unwrap()
                .as_deref(),
            Some("127.0.0.5")
        );
        assert_eq!(
            s.reserve_address("o2", cands(), |_| true)
                .unwrap()
                .as_deref(),
            Some("127.0.0.6")
        );
        assert_eq!(s.reserve_address("o3", cands(), |_| true).unwrap(), None);
        s.release_addresses("o1").unwrap();
        assert_eq!(s.rows_mentioning("o1").unwrap(), 0);
        s.delete_node("n1").unwrap();
        assert_eq!(s.count_rows("nodes").unwrap(), 0);
    });

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
    fn the_store_file_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let p = tmp();
        drop(Store::open(&p).unwrap());
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn a_postgres_url_with_a_wrong_password_fails_without_showing_it() {
        let Some(ts) = TestStore::new(Kind::Postgres, "wrong_password") else {
            return;
        };
        // The test server's user with a password it does not have.
        let url = ts.url.clone();
        let (scheme, rest) = url.split_once("://").unwrap();
        let (userinfo, host) = rest.split_once('@').unwrap();
        let user = userinfo.split(':').next().unwrap();
        let bad = format!("{scheme}://{user}:NotThePassword42@{host}");
        let err = Store::open_url(&bad, &ts.dir).err().unwrap();
        let msg = err.to_string();
        assert!(!msg.contains("NotThePassword42"), "{msg}");
        assert!(msg.contains(":***@"), "{msg}");
        assert!(msg.contains("password authentication failed"), "{msg}");
        // A server that is not there: a clear error, not a hang or a panic.
        let err = Store::open_url("postgres://u:Secret99@127.0.0.1:1/db", &ts.dir)
            .err()
            .unwrap();
        let msg = err.to_string();
        assert!(!msg.contains("Secret99"), "{msg}");
        assert!(
            msg.starts_with("cannot open the store at postgres://u:***@127.0.0.1:1/db"),
            "{msg}"
        );
    }

    #[test]
    fn a_postgres_store_can_live_in_a_schema_of_its_own() {
        let Some(ts) = TestStore::new(Kind::Postgres, "schema") else {
            return;
        };
        ts.raw("CREATE TABLE someone_elses (x INTEGER); CREATE SCHEMA lbs");
        let url = format!("{}?options=-csearch_path%3Dlbs", ts.url);
        let s = Store::open_url(&url, &ts.dir).unwrap();
        s.record_event("g", None, "k", "r").unwrap();
        drop(s);
        let s = Store::open_url(&url, &ts.dir).unwrap();
        assert_eq!(s.count_rows("events").unwrap(), 1);
        assert_eq!(
            ts.raw_text("SELECT table_schema::text FROM information_schema.tables WHERE table_name = 'events'")
                .as_deref(),
            Some("lbs")
        );
    }

    /// TLS with libpq's `sslmode` / `sslrootcert`, against the test server
    /// (scripts/postgres.sh: TLS on, a certificate for IP 127.0.0.1 only, signed
    /// by the CA at LBSCALE_TEST_POSTGRES_CA). Whether the store's own
    /// connection is encrypted is read from the server's pg_stat_ssl.
    #[test]
    fn a_postgres_store_over_tls_authenticates_the_server_as_asked() {
        let Some(ts) = TestStore::new(Kind::Postgres, "tls") else {
            return;
        };
        let Some(ca) = crate::store_testing::postgres_ca("tls") else {
            return;
        };
        let db = ts.url.rsplit('/').next().unwrap().to_string();
        // Connections to this database that are encrypted (ts.raw_text's own
        // connection is plain, so it does not count itself).
        // The connections of one open (tagged by application_name, so that a
        // backend of an earlier open still exiting does not count): how many
        // are encrypted, of how many.
        let tls_of = |tag: &str| {
            ts.raw_text(&format!(
                "SELECT count(*) FILTER (WHERE s.ssl)::text || '/' || count(*)::text \
                 FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
                 WHERE a.datname = '{db}' AND a.application_name = '{tag}'"
            ))
            .unwrap()
        };
        let open = |params: &str| Store::open_url(&format!("{}?{params}", ts.url), &ts.dir);

        let s = open(&format!(
            "sslmode=verify-full&sslrootcert={}&application_name=full",
            ca.display()
        ))
        .unwrap();
        s.record_event("g", None, "k", "over TLS").unwrap();
        assert_eq!(tls_of("full"), "1/1", "verify-full did not encrypt");
        drop(s);

        let s = open("sslmode=disable&application_name=plain").unwrap();
        s.record_event("g", None, "k", "plain").unwrap();
        assert_eq!(tls_of("plain"), "0/1", "disable encrypted");
        drop(s);

        // require: encrypted, the server not authenticated (libpq's meaning);
        // and prefer, the default, takes the server's TLS.
        let s = open("sslmode=require&application_name=req").unwrap();
        assert_eq!(s.count_rows("events").unwrap(), 2);
        assert_eq!(tls_of("req"), "1/1", "require did not encrypt");
        drop(s);
        let s = open("application_name=pref").unwrap();
        assert_eq!(tls_of("pref"), "1/1", "prefer did not encrypt");
        drop(s);

        // A CA that did not sign the server's certificate: refused.
        let other = ts.dir.join("other-ca.pem");
        let made = std::process::Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            ])
            .args(["-subj", "/CN=not the server's CA", "-keyout"])
            .arg(ts.dir.join("other-ca.key"))
            .arg("-out")
            .arg(&other)
            .output()
            .expect("run openssl");
        assert!(
            made.status.success(),
            "{}",
            String::from_utf8_lossy(&made.stderr)
        );
        let err = open(&format!(
            "sslmode=verify-ca&sslrootcert={}",
            other.display()
        ))
        .err()
        .expect("a server signed by another CA was trusted");
        assert!(err.to_string().contains("certificate"), "{err}");

        // verify-ca checks the chain only; verify-full also the name, and the
        // certificate names 127.0.0.1, not localhost.
        let by_name = ts.url.replacen("@127.0.0.1:", "@localhost:", 1);
        assert_ne!(by_name, ts.url, "the test server is not at 127.0.0.1");
        let open_by_name = |params: &str| Store::open_url(&format!("{by_name}?{params}"), &ts.dir);
        open_by_name(&format!("sslmode=verify-ca&sslrootcert={}", ca.display()))
            .expect("verify-ca checked the host name");
        let err = open_by_name(&format!("sslmode=verify-full&sslrootcert={}", ca.display()))
            .err()
            .expect("verify-full accepted a certificate for another name");
        assert!(err.to_string().contains("certificate"), "{err}");

        // Bad parameters are named; the password is never shown.
        let err = open("sslmode=verify-full").err().unwrap().to_string();
        assert!(err.contains("needs sslrootcert=PATH"), "{err}");
        let err = open("sslmode=maybe").err().unwrap().to_string();
        assert!(err.contains("sslmode: must be one of"), "{err}");
        let err = open("sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem")
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("sslrootcert: cannot read /nonexistent/ca.pem"),
            "{err}"
        );
        if let Some(pw) = crate::sqldb::password_of(&ts.url) {
            assert!(!err.contains(&pw), "{err}");
        }
    }

    #[test]
    fn the_postgres_store_reports_where_it_is_without_the_password() {
        let Some(ts) = TestStore::new(Kind::Postgres, "location") else {
            return;
        };
        let s = ts.open();
        assert_eq!(s.backend_name(), "postgres");
        assert!(s.path().is_none());
        assert_eq!(s.local_dir(), ts.dir.join(".lbscale"));
        if let Some(pw) = ts
            .url
            .split_once("://")
            .unwrap()
            .1
            .split_once('@')
            .and_then(|(u, _)| u.split_once(':'))
            .map(|(_, p)| p)
        {
            assert!(!s.location().contains(pw), "{}", s.location());
        }
    }
}
