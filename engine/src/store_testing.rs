//! Test support: the same store test over SQLite and PostgreSQL.
//!
//! [`TestStore::new`] makes a fresh, empty store of either kind: a SQLite file in
//! a new temporary directory, or a new database on the PostgreSQL server of
//! `LBSCALE_TEST_POSTGRES_URL` (scripts/postgres.sh starts a throwaway one;
//! scripts/test.sh exports it). Each test gets its own database, so tests run in
//! parallel. Without the variable, a PostgreSQL test fails when `CI=true` and is
//! skipped with a printed note otherwise: never a silent pass.
//!
//! [`store_test!`](crate::store_test) writes one test body as two tests,
//! `NAME::sqlite` and `NAME::postgres`.
//!
//! [`Link`] relays a client's connections to the test server and can stall
//! them: a server that stops answering, as that client sees it.

use crate::model::{ServiceSpec, VserverSpec};
use crate::store::{Store, StoreError, PG_WRITE_LOCK};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

mod link;
pub use link::{Link, Stall};

pub const POSTGRES_URL_VAR: &str = "LBSCALE_TEST_POSTGRES_URL";
/// The CA certificate (PEM) that signed the test server's TLS certificate.
pub const POSTGRES_CA_VAR: &str = "LBSCALE_TEST_POSTGRES_CA";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Sqlite,
    Postgres,
}

/// A fresh store for one test; its PostgreSQL database is dropped at the end.
pub struct TestStore {
    pub kind: Kind,
    /// The URL to open it with (`Store::open_url`, the provider's `state`).
    pub url: String,
    /// A private directory (the SQLite file's, and the base for relative paths).
    pub dir: PathBuf,
    admin_url: Option<String>,
    database: Option<String>,
}

/// Runs `f` to its end on a runtime of its own: store tests run on plain
/// threads, and the store calls that the daemon makes are async.
pub fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a test runtime")
        .block_on(f)
}

/// The PostgreSQL server the tests use, if configured. Panics when it is not
/// and `CI=true`; prints a note and answers `None` otherwise.
pub fn postgres_admin_url(test: &str) -> Option<String> {
    match std::env::var(POSTGRES_URL_VAR) {
        Ok(u) if !u.is_empty() => Some(u),
        _ if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") => panic!(
            "{test}: {POSTGRES_URL_VAR} is not set but CI=true: the PostgreSQL store tests \
             must run on CI (scripts/test.sh starts a server with scripts/postgres.sh)"
        ),
        _ => {
            // Straight to stderr, not through the test harness's capture: a
            // skipped variant must be visible in the output of a passing run.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "note: {test}: SKIPPED the PostgreSQL variant: {POSTGRES_URL_VAR} is not set \
                 (scripts/test.sh sets it; or export {POSTGRES_URL_VAR}=$(scripts/postgres.sh start))"
            );
            None
        }
    }
}

/// The test server's CA certificate, if configured; as [`postgres_admin_url`]:
/// required when `CI=true`, a printed skip otherwise.
pub fn postgres_ca(test: &str) -> Option<PathBuf> {
    match std::env::var(POSTGRES_CA_VAR) {
        Ok(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") => {
            panic!("{test}: {POSTGRES_CA_VAR} is not set but CI=true (scripts/test.sh sets it)")
        }
        _ => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "note: {test}: SKIPPED the TLS checks: {POSTGRES_CA_VAR} is not set \
                 (export {POSTGRES_CA_VAR}=$(scripts/postgres.sh ca))"
            );
            None
        }
    }
}

static N: AtomicU64 = AtomicU64::new(0);

fn unique(name: &str) -> String {
    let clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    let mut s = format!(
        "lbt_{}_{}_{clean}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    );
    s.truncate(63);
    s
}

/// `url` with its database replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
    let (scheme, authority, tail) = url_parts(url);
    match tail.split_once('?') {
        Some((_, query)) => format!("{scheme}://{authority}/{db}?{query}"),
        None => format!("{scheme}://{authority}/{db}"),
    }
}

/// A `scheme://authority/path?query` URL's scheme, authority and the rest
/// (`/path?query`, either part possibly absent).
fn url_parts(url: &str) -> (&str, &str, &str) {
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    (scheme, &rest[..end], &rest[end..])
}

/// Runs `f` with a plain PostgreSQL client on a thread of its own (the sync
/// client must not run on a Tokio worker thread; acceptance tests are async).
pub fn with_pg_client<T: Send + 'static>(
    url: &str,
    f: impl FnOnce(&mut postgres::Client) -> Result<T, postgres::Error> + Send + 'static,
) -> Result<T, String> {
    let url = url.to_string();
    std::thread::spawn(move || {
        let mut c = url
            .parse::<postgres::Config>()
            .map_err(|e| e.to_string())?
            .connect(postgres::NoTls)
            .map_err(|e| e.to_string())?;
        f(&mut c).map_err(|e| match e.as_db_error() {
            Some(db) => db.message().to_string(),
            None => e.to_string(),
        })
    })
    .join()
    .expect("postgres test thread")
}

/// The backend pids of the test server's connections named `app` (the
/// `application_name` of a store's URL).
pub fn backends_named(url: &str, app: &str) -> Vec<i32> {
    let name = app.to_string();
    with_pg_client(url, move |c| {
        Ok(c.query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
            &[&name],
        )?
        .iter()
        .map(|r| r.get::<_, i32>(0))
        .collect())
    })
    .unwrap_or_else(|e| panic!("listing the backends named {app}: {e}"))
}

impl TestStore {
    /// A fresh store; `None` only for a skipped PostgreSQL variant.
    pub fn new(kind: Kind, name: &str) -> Option<TestStore> {
        let dir = std::env::temp_dir().join(unique(&format!("lbscale-store-{name}")));
        std::fs::create_dir_all(&dir).unwrap();
        match kind {
            Kind::Sqlite => Some(TestStore {
                kind,
                url: format!("sqlite://{}", dir.join("state.db").display()),
                dir,
                admin_url: None,
                database: None,
            }),
            Kind::Postgres => {
                let admin = postgres_admin_url(name)?;
                let db = unique(name);
                let create = format!("CREATE DATABASE {db}");
                with_pg_client(&admin, move |c| c.batch_execute(&create))
                    .unwrap_or_else(|e| panic!("creating test database {db}: {e}"));
                Some(TestStore {
                    kind,
                    url: with_database(&admin, &db),
                    dir,
                    admin_url: Some(admin),
                    database: Some(db),
                })
            }
        }
    }

    pub fn try_open(&self) -> Result<Store, StoreError> {
        Store::open_url(&self.url, &self.dir)
    }

    pub fn open(&self) -> Store {
        self.try_open().expect("open the test store")
    }

    /// Runs SQL on the database directly (no migration, no checks).
    pub fn raw(&self, sql: &str) {
        match self.kind {
            Kind::Sqlite => {
                let c = rusqlite::Connection::open(self.dir.join("state.db")).unwrap();
                c.execute_batch(sql).unwrap();
            }
            Kind::Postgres => {
                let sql = sql.to_string();
                with_pg_client(&self.url, move |c| c.batch_execute(&sql)).unwrap();
            }
        }
    }

    /// The first column of the first row of `sql`, as text, read directly.
    pub fn raw_text(&self, sql: &str) -> Option<String> {
        match self.kind {
            Kind::Sqlite => {
                let c = rusqlite::Connection::open(self.dir.join("state.db")).unwrap();
                c.query_row(sql, [], |r| r.get::<_, String>(0)).ok()
            }
            Kind::Postgres => {
                let sql = sql.to_string();
                with_pg_client(&self.url, move |c| {
                    Ok(c.query_opt(&sql, &[])?.map(|r| r.get::<_, String>(0)))
                })
                .unwrap()
            }
        }
    }

    /// Holds the store's write lock from another connection (another process)
    /// until the guard is dropped.
    pub fn hold_write_lock(&self) -> WriteLock {
        let (locked_tx, locked_rx) = mpsc::channel::<()>();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let kind = self.kind;
        let url = self.url.clone();
        let path = self.dir.join("state.db");
        let thread = std::thread::spawn(move || match kind {
            Kind::Sqlite => {
                let mut c = rusqlite::Connection::open(path).unwrap();
                let tx = c
                    .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                    .unwrap();
                locked_tx.send(()).unwrap();
                let _ = release_rx.recv();
                drop(tx);
            }
            Kind::Postgres => {
                let mut c = url
                    .parse::<postgres::Config>()
                    .unwrap()
                    .connect(postgres::NoTls)
                    .unwrap();
                let mut tx = c.transaction().unwrap();
                tx.batch_execute(&format!("SELECT pg_advisory_xact_lock({PG_WRITE_LOCK})"))
                    .unwrap();
                locked_tx.send(()).unwrap();
                let _ = release_rx.recv();
                tx.rollback().unwrap();
            }
        });
        locked_rx.recv().expect("the lock holder started");
        WriteLock {
            release: Some(release_tx),
            thread: Some(thread),
        }
    }
}

pub struct WriteLock {
    release: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for WriteLock {
    fn drop(&mut self) {
        drop(self.release.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for TestStore {
    fn drop(&mut self) {
        if let (Some(admin), Some(db)) = (self.admin_url.clone(), self.database.clone()) {
            if !std::thread::panicking() {
                let _ = with_pg_client(&admin, move |c| {
                    c.batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
                });
            }
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// `store_test!(name, |ts| { ... })`: the body as `name::sqlite` and
/// `name::postgres`, with `ts` a fresh [`TestStore`] of each kind.
#[macro_export]
macro_rules! store_test {
    ($name:ident, |$ts:ident| $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            #[test]
            fn sqlite() {
                let $ts = $crate::store_testing::TestStore::new(
                    $crate::store_testing::Kind::Sqlite,
                    stringify!($name),
                )
                .unwrap();
                $body
            }
            #[test]
            fn postgres() {
                let Some($ts) = $crate::store_testing::TestStore::new(
                    $crate::store_testing::Kind::Postgres,
                    stringify!($name),
                ) else {
                    return;
                };
                $body
            }
        }
    };
}

/// A vserver of `se_group` with one service (the discard port of 127.0.0.1),
/// as the store's tests declare them.
pub fn vserver_spec(name: &str, se_group: &str, service_type: &str, port: i64) -> VserverSpec {
    VserverSpec {
        name: name.into(),
        se_group_id: se_group.into(),
        service_type: service_type.into(),
        port,
        lb_method: "ROUNDROBIN".into(),
        persistence: "NONE".into(),
        services: vec![ServiceSpec {
            name: format!("{name}-s1"),
            address: "127.0.0.1".into(),
            port: 9,
            weight: 1,
            enabled: true,
        }],
        slow_start: None,
        max_connections: 0,
        udp_health_request: String::new(),
    }
}
