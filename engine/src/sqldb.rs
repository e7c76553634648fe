//! The store's small SQL layer: one set of queries, two databases.
//!
//! The store writes its SQL once, in the portable subset that SQLite and
//! PostgreSQL share, with `?N` placeholders, and runs it through [`Db`]:
//! `query`, `execute` and `batch` over [`Value`]s (integers, text, NULL). The
//! differences between the two databases are all here:
//!
//! - placeholders: `?N` as written for SQLite, `$N` for PostgreSQL;
//! - DDL ([`pg_ddl`]): PostgreSQL gets `BIGINT` for every integer column (it has
//!   strict integer types), an identity column for `AUTOINCREMENT`, and `TEXT
//!   COLLATE "C"` so that `ORDER BY` sorts as SQLite's byte order does;
//! - which tables exist ([`Dialect::tables_sql`]);
//! - errors: a lock wait that timed out is [`StoreError::Locked`] on both.
//!
//! - the clock: [`NOW_MS`] in a statement is the database's own clock.
//!
//! PostgreSQL is reached through the synchronous `postgres` client, which runs its
//! own Tokio runtime and must not be called on a thread that drives async tasks
//! (the provider and the daemon call the store from async code). So each client
//! lives on a dedicated thread ([`PgConn`]); each call sends it the SQL and owned
//! parameters over a channel and waits for the rows, at most the call's
//! deadline. An async caller can instead hand a connection's thread a whole
//! function of statements ([`PgConn::run`]) and await its answer, with no
//! thread of its own blocked. Connections come from small pools ([`PgPool`]) whose lock is never
//! held across a call: a connection that stalls (a stopped server, a half-open
//! socket) is given up at its deadline, while the others, and the pool kept for
//! lease renewals, go on. Every connection has TCP keepalives, a connect
//! timeout, the server's `statement_timeout`, `lock_timeout` and
//! `idle_in_transaction_session_timeout`, and is closed after an idle timeout.

use crate::store::{Result, StoreError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Statements sent to a database by this process (each `query`, `execute`
/// and `batch`: one round trip on PostgreSQL), for what the daemon and the
/// benchmarks report as the store's load.
static STATEMENTS: AtomicU64 = AtomicU64::new(0);

/// Statements this process sent to its stores so far.
pub(crate) fn statements_sent() -> u64 {
    STATEMENTS.load(Ordering::Relaxed)
}

thread_local! {
    /// Statements sent from this thread (a store call sends its statements
    /// from the caller's thread), for tests that count what one call costs
    /// while other tests run in the same process.
    static SENT_HERE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Statements sent from the calling thread so far.
pub(crate) fn statements_sent_here() -> u64 {
    SENT_HERE.with(|c| c.get())
}

fn count_statement() {
    count_statements(1);
}

fn count_statements(n: u64) {
    STATEMENTS.fetch_add(n, Ordering::Relaxed);
    count_here(n);
}

/// Counts on the calling thread statements already counted for the process:
/// those a function run on a connection's thread sent ([`PgConn::run`]).
fn count_here(n: u64) {
    SENT_HERE.with(|c| c.set(c.get() + n));
}

/// A parameter or a column value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Null,
    Int(i64),
    Text(String),
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Int(v as i64)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Text(v.to_string())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Text(v)
    }
}
impl From<&String> for Value {
    fn from(v: &String) -> Self {
        Value::Text(v.clone())
    }
}
impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map_or(Value::Null, Into::into)
    }
}
impl From<&Option<String>> for Value {
    fn from(v: &Option<String>) -> Self {
        v.as_deref().map_or(Value::Null, Into::into)
    }
}

/// `vals![a, b]`: the parameters of a statement.
macro_rules! vals {
    ($($v:expr),* $(,)?) => { &[$($crate::sqldb::Value::from($v)),*][..] };
}
pub(crate) use vals;

/// One result row.
#[derive(Debug, Clone)]
pub(crate) struct SqlRow(Vec<Value>);

impl SqlRow {
    fn col(&self, i: usize) -> Result<&Value> {
        self.0
            .get(i)
            .ok_or_else(|| StoreError::Sql(format!("no column {i} in the result")))
    }
    pub fn int(&self, i: usize) -> Result<i64> {
        match self.col(i)? {
            Value::Int(v) => Ok(*v),
            other => Err(StoreError::Sql(format!(
                "column {i}: expected an integer, found {other:?}"
            ))),
        }
    }
    pub fn text(&self, i: usize) -> Result<String> {
        match self.col(i)? {
            Value::Text(v) => Ok(v.clone()),
            other => Err(StoreError::Sql(format!(
                "column {i}: expected text, found {other:?}"
            ))),
        }
    }
    pub fn opt_text(&self, i: usize) -> Result<Option<String>> {
        match self.col(i)? {
            Value::Null => Ok(None),
            _ => self.text(i).map(Some),
        }
    }
}

/// A connection (or an open transaction) of either database.
pub(crate) trait Db {
    fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<SqlRow>>;
    /// Runs one statement; the number of rows it changed.
    fn execute(&mut self, sql: &str, params: &[Value]) -> Result<u64>;
    /// Runs several statements without parameters (DDL).
    fn batch(&mut self, sql: &str) -> Result<()>;
    fn dialect(&self) -> Dialect;

    /// The first row, if any.
    fn one(&mut self, sql: &str, params: &[Value]) -> Result<Option<SqlRow>> {
        Ok(self.query(sql, params)?.into_iter().next())
    }
    /// The first column of the first row, which must exist (`count(*)` and the like).
    fn int(&mut self, sql: &str, params: &[Value]) -> Result<i64> {
        match self.one(sql, params)? {
            Some(r) => r.int(0),
            None => Err(StoreError::Sql(format!("no row from {sql}"))),
        }
    }
}

/// Written in a statement, the database's own clock in Unix milliseconds:
/// lease expiries are set and compared by the one clock of the database, never
/// by the clocks of the hosts that share it.
pub(crate) const NOW_MS: &str = "{{now_ms}}";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    Sqlite,
    Postgres,
}

impl Dialect {
    /// The DDL of a migration as this database needs it.
    pub fn ddl(self, sql: &str) -> String {
        match self {
            Dialect::Sqlite => sql.to_string(),
            Dialect::Postgres => pg_ddl(sql),
        }
    }
    /// `sql` with [`NOW_MS`] as this database's clock reads it.
    pub fn with_clock(self, sql: &str) -> String {
        let now = match self {
            // Rounded: SQLite's clock is whole milliseconds, and the
            // floating-point day fraction truncated could read 1 ms early.
            Dialect::Sqlite => {
                "CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"
            }
            Dialect::Postgres => "(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
        };
        sql.replace(NOW_MS, now)
    }
    /// The number at `key` of the JSON object in text `column`, compared
    /// exactly (no cast that could fail or round); NULL where it has none, or
    /// something else there. `key` is a constant of the code, never input.
    pub fn json_number(self, column: &str, key: &str) -> String {
        match self {
            Dialect::Sqlite => format!(
                "(CASE WHEN json_type({column}, '$.{key}') IN ('integer', 'real') \
                 THEN json_extract({column}, '$.{key}') END)"
            ),
            Dialect::Postgres => format!(
                "(CASE WHEN jsonb_typeof(({column})::jsonb -> '{key}') = 'number' \
                 THEN (({column})::jsonb ->> '{key}')::numeric END)"
            ),
        }
    }
    /// Counts the store's tables other than `meta`.
    pub fn tables_sql(self) -> &'static str {
        match self {
            Dialect::Sqlite => {
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name != 'meta'"
            }
            Dialect::Postgres => {
                "SELECT count(*) FROM information_schema.tables
                 WHERE table_schema = current_schema() AND table_name != 'meta'"
            }
        }
    }
}

/// SQLite DDL as PostgreSQL takes it. The migrations are written for SQLite (their
/// text is what existing SQLite stores were created with); only these words differ.
pub(crate) fn pg_ddl(sql: &str) -> String {
    sql.replace(
        "INTEGER PRIMARY KEY AUTOINCREMENT",
        "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    )
    .replace("INTEGER", "BIGINT")
    .replace("TEXT", "TEXT COLLATE \"C\"")
}

/// `?N` placeholders as `$N` (outside string literals and quoted identifiers).
pub(crate) fn pg_placeholders(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut quote: Option<char> = None;
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        match quote {
            Some(q) => {
                if c == q {
                    quote = None;
                }
                out.push(c);
            }
            None if c == '\'' || c == '"' => {
                quote = Some(c);
                out.push(c);
            }
            None if c == '?' && chars.peek().is_some_and(|d| d.is_ascii_digit()) => out.push('$'),
            None => out.push(c),
        }
    }
    out
}

// --- SQLite -------------------------------------------------------------------------

pub(crate) struct SqliteDb<'a>(pub &'a rusqlite::Connection);

impl rusqlite::ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(match self {
            Value::Null => ToSqlOutput::Borrowed(ValueRef::Null),
            Value::Int(v) => ToSqlOutput::Borrowed(ValueRef::Integer(*v)),
            Value::Text(s) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
        })
    }
}

impl Db for SqliteDb<'_> {
    fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<SqlRow>> {
        count_statement();
        let mut st = self.0.prepare_cached(&Dialect::Sqlite.with_clock(sql))?;
        let n = st.column_count();
        let mut rows = st.query(rusqlite::params_from_iter(params))?;
        let mut out = Vec::new();
        while let Some(r) = rows.next()? {
            let mut row = Vec::with_capacity(n);
            for i in 0..n {
                use rusqlite::types::ValueRef;
                row.push(match r.get_ref(i)? {
                    ValueRef::Null => Value::Null,
                    ValueRef::Integer(v) => Value::Int(v),
                    ValueRef::Text(t) => Value::Text(String::from_utf8_lossy(t).into_owned()),
                    other => {
                        return Err(StoreError::Sql(format!(
                            "column {i}: unexpected {:?} value",
                            other.data_type()
                        )))
                    }
                });
            }
            out.push(SqlRow(row));
        }
        Ok(out)
    }
    fn execute(&mut self, sql: &str, params: &[Value]) -> Result<u64> {
        count_statement();
        let mut st = self.0.prepare_cached(&Dialect::Sqlite.with_clock(sql))?;
        Ok(st.execute(rusqlite::params_from_iter(params))? as u64)
    }
    fn batch(&mut self, sql: &str) -> Result<()> {
        count_statement();
        Ok(self.0.execute_batch(sql)?)
    }
    fn dialect(&self) -> Dialect {
        Dialect::Sqlite
    }
}

// --- PostgreSQL -----------------------------------------------------------------------

impl postgres::types::ToSql for Value {
    fn to_sql(
        &self,
        ty: &postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> std::result::Result<postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>>
    {
        use postgres::types::{IsNull, Type};
        match self {
            Value::Null => Ok(IsNull::Yes),
            Value::Int(v) => match *ty {
                Type::INT8 => v.to_sql(ty, out),
                Type::INT4 => i32::try_from(*v)?.to_sql(ty, out),
                Type::INT2 => i16::try_from(*v)?.to_sql(ty, out),
                Type::BOOL => (*v != 0).to_sql(ty, out),
                _ => v.to_string().as_str().to_sql(ty, out),
            },
            Value::Text(s) => s.as_str().to_sql(ty, out),
        }
    }
    fn accepts(_: &postgres::types::Type) -> bool {
        true
    }
    postgres::types::to_sql_checked!();
}

fn pg_row(r: &postgres::Row) -> std::result::Result<SqlRow, String> {
    use postgres::types::Type;
    let mut row = Vec::with_capacity(r.len());
    for (i, c) in r.columns().iter().enumerate() {
        let v = match *c.type_() {
            Type::INT8 => r.try_get::<_, Option<i64>>(i).map(|v| v.map(Value::Int)),
            Type::INT4 => r
                .try_get::<_, Option<i32>>(i)
                .map(|v| v.map(|v| Value::Int(v.into()))),
            Type::INT2 => r
                .try_get::<_, Option<i16>>(i)
                .map(|v| v.map(|v| Value::Int(v.into()))),
            Type::BOOL => r
                .try_get::<_, Option<bool>>(i)
                .map(|v| v.map(|v| Value::Int(v as i64))),
            _ => r
                .try_get::<_, Option<String>>(i)
                .map(|v| v.map(Value::Text)),
        }
        .map_err(|e| format!("column {:?}: {e}", c.name()))?;
        row.push(v.unwrap_or(Value::Null));
    }
    Ok(SqlRow(row))
}

enum Req {
    Query(String, Vec<Value>),
    Execute(String, Vec<Value>),
    Batch(String),
}

/// What a connection's thread is given: one statement, whose answer the
/// caller waits for, or a caller's whole function of statements
/// ([`PgConn::run`]), which answers by itself.
enum Job {
    Call(Req, mpsc::SyncSender<Reply>),
    Run(Box<dyn FnOnce(&mut Direct<'_>) + Send>),
}

enum Answer {
    Rows(Vec<SqlRow>),
    Count(u64),
    Done,
}

/// Why a PostgreSQL call failed, as the worker thread reports it.
#[derive(Debug, Clone)]
pub(crate) struct PgFailure {
    pub code: Option<String>,
    pub message: String,
}

type Reply = std::result::Result<Answer, PgFailure>;

/// The deadlines and limits of the store's PostgreSQL connections.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PgLimits {
    /// How long a statement waits for a lock (`lock_timeout`): the store's
    /// write lock, a row another writer holds.
    pub lock_wait: Duration,
    /// The server's `statement_timeout` (and `idle_in_transaction_session_timeout`):
    /// a statement, or a transaction left open by a client that went away, ends
    /// this long after it started. Longer than `lock_wait`.
    pub statement_timeout: Duration,
    /// How long a call waits for the server's answer before it gives the
    /// connection up as stalled (a stopped server, a half-open socket): the
    /// server's own timeouts cannot fire when the server does not run.
    pub call_deadline: Duration,
    /// A connection unused this long is closed instead of reused.
    pub idle_timeout: Duration,
    /// Connections of one pool, stalled ones included until their thread ends.
    pub max_connections: usize,
}

impl PgLimits {
    pub fn new(lock_wait: Duration) -> PgLimits {
        let statement_timeout = lock_wait + Duration::from_secs(5);
        PgLimits {
            lock_wait,
            statement_timeout,
            call_deadline: statement_timeout + Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            max_connections: 4,
        }
    }
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// TCP keepalives: a peer that vanished (a host gone, a network cut) is noticed
/// after about 15 + 3 × 5 s instead of the system's two hours.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 3;

/// How to open connections to one PostgreSQL store (shared by its pools).
#[derive(Clone)]
pub(crate) struct PgTarget {
    config: postgres::Config,
    tls: tokio_postgres_rustls::MakeRustlsConnect,
    /// The URL with its password masked, for messages.
    redacted: String,
    /// The password (if any), so that no message can carry it.
    secret: Option<String>,
}

impl PgTarget {
    /// Reads the URL (and its TLS parameters); connects to nothing yet.
    pub fn parse(url: &str) -> Result<PgTarget> {
        let redacted = redact_url(url);
        let secret = password_of(url);
        let invalid = |detail: String| StoreError::Open {
            store: redacted.clone(),
            detail: scrub(&detail, secret.as_deref()),
        };
        let (url, tls) = crate::pgtls::split_tls_params(url).map_err(&invalid)?;
        let connector = tls.connector().map_err(&invalid)?;
        let mut config: postgres::Config = url.parse().map_err(|e: postgres::Error| {
            StoreError::Sql(scrub(
                &format!("the store URL {redacted} is not a valid PostgreSQL URL: {e}"),
                secret.as_deref(),
            ))
        })?;
        // An unreachable server fails the call instead of hanging for the
        // system's TCP timeout; a vanished peer is noticed by keepalives. The
        // URL's own `connect_timeout` / `keepalives_*` win.
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        let query = url.split_once('?').map_or("", |(_, q)| q);
        config.keepalives(true);
        if !query.contains("keepalives_idle") {
            config.keepalives_idle(KEEPALIVE_IDLE);
        }
        if !query.contains("keepalives_interval") {
            config.keepalives_interval(KEEPALIVE_INTERVAL);
        }
        if !query.contains("keepalives_retries") {
            config.keepalives_retries(KEEPALIVE_RETRIES);
        }
        config.ssl_mode(tls.client_mode());
        Ok(PgTarget {
            config,
            tls: connector,
            redacted,
            secret,
        })
    }

    pub fn redacted(&self) -> &str {
        &self.redacted
    }
}

/// A PostgreSQL connection owned by its own thread (see the module docs).
pub(crate) struct PgConn {
    tx: mpsc::Sender<Job>,
    secret: Option<String>,
    /// How long a call waits for its answer (see [`PgLimits::call_deadline`]).
    deadline: Duration,
    /// A call timed out: the thread may still be blocked in it, so the
    /// connection is never used again (it ends when that call does).
    stalled: bool,
    idle_since: Instant,
    /// Its thread's state, shared with the thread's [`Slot`].
    state: Arc<AtomicU8>,
    stalls: Arc<AtomicUsize>,
}

/// Counts a pool's live connection threads; the thread's guard gives its
/// slot back when it ends (however late a stalled call returns), and its
/// count of stalled calls with it, and wakes a caller that waits for room.
struct Slot {
    threads: Arc<AtomicUsize>,
    stalls: Arc<AtomicUsize>,
    freed: Arc<tokio::sync::Notify>,
    /// [`RUNNING`], [`STALLED`] (a call or its connect gave up on it) or
    /// [`ENDED`].
    state: Arc<AtomicU8>,
}

const RUNNING: u8 = 0;
const STALLED: u8 = 1;
const ENDED: u8 = 2;

/// Counts a thread given up on (a call or a connect that got no answer by
/// its deadline) as stalled until it ends, unless it already did. Counted
/// before the state moves, so that the count never dips below zero when the
/// thread ends in between (`Slot::drop` takes it back after the move).
fn mark_stalled(state: &AtomicU8, stalls: &AtomicUsize) {
    stalls.fetch_add(1, Ordering::SeqCst);
    if state
        .compare_exchange(RUNNING, STALLED, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        stalls.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.state.swap(ENDED, Ordering::SeqCst) == STALLED {
            self.stalls.fetch_sub(1, Ordering::SeqCst);
        }
        self.threads.fetch_sub(1, Ordering::SeqCst);
        self.freed.notify_one();
    }
}

impl PgConn {
    /// Connects on a new thread, with the session settings of `limits`,
    /// waiting at most `within` for the connection to be ready (connect,
    /// TLS, authentication, settings). A connect given up on counts as a
    /// stalled call until its thread ends; `slot` is released then.
    fn connect(
        target: &PgTarget,
        limits: PgLimits,
        slot: Slot,
        within: Duration,
    ) -> Result<PgConn> {
        let open_err = |detail: String| StoreError::Open {
            store: target.redacted.clone(),
            detail: scrub(&detail, target.secret.as_deref()),
        };
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (config, tls) = (target.config.clone(), target.tls.clone());
        let secret = target.secret.clone();
        let (state, stalls) = (slot.state.clone(), slot.stalls.clone());
        std::thread::Builder::new()
            .name("lbscale-postgres".into())
            .spawn(move || {
                let _slot = slot;
                worker(config, tls, limits, secret, rx, ready_tx)
            })
            .map_err(|e| StoreError::Sql(format!("cannot start the PostgreSQL thread: {e}")))?;
        match ready_rx.recv_timeout(within) {
            Ok(Ok(())) => Ok(PgConn {
                tx,
                secret: target.secret.clone(),
                deadline: limits.call_deadline,
                stalled: false,
                idle_since: Instant::now(),
                state,
                stalls,
            }),
            Ok(Err(f)) => Err(open_err(f.message)),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                mark_stalled(&state, &stalls);
                Err(StoreError::Unreachable(format!(
                    "{}: no connection within {} ms",
                    target.redacted,
                    within.as_millis()
                )))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(open_err("the PostgreSQL thread ended".into()))
            }
        }
    }

    fn call(&mut self, req: Req) -> Result<Answer> {
        if self.stalled {
            return Err(StoreError::Unreachable(
                "the PostgreSQL connection stalled earlier".into(),
            ));
        }
        let (reply_tx, reply_rx) = mpsc::sync_channel(1);
        self.tx
            .send(Job::Call(req, reply_tx))
            .map_err(|_| thread_gone())?;
        // Counted once handed to the connection's thread: a statement refused
        // here (the ROLLBACK after a stall) never reaches the server.
        count_statement();
        let reply = match reply_rx.recv_timeout(self.deadline) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => return Err(self.gave_up()),
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(thread_gone()),
        };
        reply.map_err(|f| store_error(f, self.secret.as_deref()))
    }

    /// Runs `f` on the connection's own thread and waits for its answer
    /// without blocking the caller's thread: its statements go to the server
    /// from there, with no hand-off each, and a caller on an async runtime
    /// holds up none of its workers. At most the call's deadline for all of
    /// `f`. A caller that stops waiting early leaves `f` to finish on the
    /// thread, before the connection's next call.
    async fn run<T: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut dyn Db) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        if self.stalled {
            return Err(StoreError::Unreachable(
                "the PostgreSQL connection stalled earlier".into(),
            ));
        }
        let (answer_tx, answer_rx) = tokio::sync::oneshot::channel();
        let job = Job::Run(Box::new(move |db: &mut Direct<'_>| {
            let r = f(db);
            let _ = answer_tx.send((r, db.sent));
        }));
        self.tx.send(job).map_err(|_| thread_gone())?;
        // Until the answer comes, the connection counts as stalled: a caller
        // that stops waiting (its future dropped) leaves it out of the pool,
        // not given to the next caller behind a call that may still run.
        self.stalled = true;
        match tokio::time::timeout(self.deadline, answer_rx).await {
            Ok(Ok((r, sent))) => {
                self.stalled = false;
                count_here(sent);
                r
            }
            Ok(Err(_)) => Err(thread_gone()),
            Err(_) => Err(self.gave_up()),
        }
    }

    /// A call got no answer by its deadline: the thread may still be blocked
    /// in it, so the connection is never used again.
    fn gave_up(&mut self) -> StoreError {
        self.stalled = true;
        mark_stalled(&self.state, &self.stalls);
        StoreError::Unreachable(format!(
            "PostgreSQL did not answer within {} ms",
            self.deadline.as_millis()
        ))
    }
}

fn thread_gone() -> StoreError {
    StoreError::Sql("the PostgreSQL connection thread is gone".into())
}

/// A failure as the store reports it, with no password in it.
fn store_error(f: PgFailure, secret: Option<&str>) -> StoreError {
    let message = scrub(&f.message, secret);
    match f.code.as_deref() {
        // lock_not_available: lock_timeout passed while waiting.
        Some("55P03") => StoreError::Locked(message),
        // query_canceled: statement_timeout (or a cancel request).
        Some("57014") => StoreError::Unreachable(message),
        // connection_exception: the socket failed or closed.
        Some(c) if c.starts_with("08") => StoreError::Unreachable(message),
        _ => StoreError::Sql(message),
    }
}

/// A PostgreSQL connection as a statement reaches it: the request built from
/// the store's SQL, and its answer. [`PgConn`] hands it to the connection's
/// thread; [`Direct`], on that thread, sends it to the server.
trait Serve {
    fn serve(&mut self, req: Req) -> Result<Answer>;
}

impl<S: Serve> Db for S {
    fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<SqlRow>> {
        let sql = Dialect::Postgres.with_clock(&pg_placeholders(sql));
        match self.serve(Req::Query(sql, params.to_vec()))? {
            Answer::Rows(r) => Ok(r),
            _ => unreachable!("a query answers rows"),
        }
    }
    fn execute(&mut self, sql: &str, params: &[Value]) -> Result<u64> {
        let sql = Dialect::Postgres.with_clock(&pg_placeholders(sql));
        match self.serve(Req::Execute(sql, params.to_vec()))? {
            Answer::Count(n) => Ok(n),
            _ => unreachable!("an execute answers a count"),
        }
    }
    fn batch(&mut self, sql: &str) -> Result<()> {
        self.serve(Req::Batch(sql.to_string())).map(|_| ())
    }
    fn dialect(&self) -> Dialect {
        Dialect::Postgres
    }
}

impl Serve for PgConn {
    fn serve(&mut self, req: Req) -> Result<Answer> {
        self.call(req)
    }
}

/// A few connections to one store, each on its own thread. The pool's lock is
/// held only to take or give back a connection, never across a call; a call
/// that stalls past its deadline loses its connection (not the pool), and its
/// thread keeps its slot until the call returns, so that a stalled server is
/// not answered with ever more connections.
pub(crate) struct PgPool {
    target: PgTarget,
    limits: PgLimits,
    /// Shared with the threads that open connections for [`PgPool::get_async`]:
    /// a connection opened for a caller that stopped waiting is kept there.
    idle: Arc<Idle>,
    threads: Arc<AtomicUsize>,
    /// Calls (and connects) that got no answer by their deadline and still
    /// wait for it.
    stalls: Arc<AtomicUsize>,
    /// For messages: which pool ("store", "leases").
    name: &'static str,
}

impl PgPool {
    pub fn new(target: PgTarget, limits: PgLimits, name: &'static str) -> PgPool {
        PgPool {
            target,
            limits,
            idle: Arc::new(Idle {
                conns: Mutex::new(Vec::new()),
                freed: Condvar::new(),
                freed_async: Arc::new(tokio::sync::Notify::new()),
                timeout: limits.idle_timeout,
            }),
            threads: Arc::new(AtomicUsize::new(0)),
            stalls: Arc::new(AtomicUsize::new(0)),
            name,
        }
    }

    /// A connection, waiting at most `wait` for one to be free, and then, if
    /// the pool has room for a new one, at most the connect timeout plus the
    /// pool's call deadline to open it; each of its calls waits at most
    /// `deadline` for its answer.
    pub fn get(&self, wait: Duration, deadline: Duration) -> Result<Pooled<'_>> {
        self.get_opening_within(wait, deadline, self.open_wait())
    }

    /// How long opening a connection may take for an ordinary call.
    fn open_wait(&self) -> Duration {
        let connect = self.target.config.get_connect_timeout().copied();
        connect.unwrap_or(CONNECT_TIMEOUT) + self.limits.call_deadline
    }

    /// As [`PgPool::get`], opening a new connection within `open` (the health
    /// probe's own deadline, not a whole connect timeout, for a server that
    /// accepts connections and answers nothing).
    pub fn get_opening_within(
        &self,
        wait: Duration,
        deadline: Duration,
        open: Duration,
    ) -> Result<Pooled<'_>> {
        let until = Instant::now() + wait;
        let mut idle = self.idle.conns.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(c) = self.take_idle(&mut idle, deadline) {
                return Ok(c);
            }
            if let Some(slot) = self.reserve() {
                drop(idle);
                let mut c = PgConn::connect(&self.target, self.limits, slot, open)?;
                c.deadline = deadline;
                return Ok(Pooled {
                    pool: self,
                    conn: Some(c),
                });
            }
            let now = Instant::now();
            if now >= until {
                return Err(self.all_busy(wait));
            }
            // A stalled thread that ends does not signal: look again soon.
            let step = (until - now).min(Duration::from_millis(50));
            idle = self
                .idle
                .freed
                .wait_timeout(idle, step)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// As [`PgPool::get`] (each call with the pool's call deadline), for a
    /// caller on an async runtime: it waits for a free connection without
    /// holding a thread, at most `wait`, and opens a new one (if the pool has
    /// room) on a blocking-pool thread, within the connect timeout and a call
    /// deadline as [`PgPool::get`] does; if the caller stops waiting
    /// meanwhile, the new connection goes to the idle ones. A burst of
    /// evaluations that finds every connection busy waits here, not in
    /// threads of their own. The
    /// waiters are served about in the order they began to wait (a caller
    /// keeps its place in the queue of [`tokio::sync::Notify`] until it is
    /// woken), though one that comes when a connection is idle takes it at once.
    pub async fn get_async(&self, wait: Duration) -> Result<Pooled<'_>> {
        let until = tokio::time::Instant::now() + wait;
        // Registered before each look, so that a connection given back
        // between the look and the wait is not missed.
        let freed = self.idle.freed_async.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        loop {
            if let Some(c) = self.idle_now() {
                return Ok(c);
            }
            if let Some(slot) = self.reserve() {
                let (target, limits, idle) = (self.target.clone(), self.limits, self.idle.clone());
                let open = self.open_wait();
                let (opened_tx, opened) = tokio::sync::oneshot::channel();
                tokio::task::spawn_blocking(move || {
                    let conn = PgConn::connect(&target, limits, slot, open);
                    // The caller stopped waiting (its task was cancelled):
                    // the connection is kept for the next one, not closed.
                    if let Err(Ok(conn)) = opened_tx.send(conn) {
                        idle.put(conn);
                    }
                });
                let mut opening = Opening {
                    opened,
                    idle: self.idle.clone(),
                };
                let conn = (&mut opening.opened).await.map_err(|_| {
                    StoreError::Sql(format!(
                        "opening a connection of the {} pool to {}: the thread opening it ended before it answered (it panicked, or the runtime is shutting down)",
                        self.name, self.target.redacted
                    ))
                })??;
                return Ok(Pooled {
                    pool: self,
                    conn: Some(conn),
                });
            }
            let now = tokio::time::Instant::now();
            if now >= until {
                return Err(self.all_busy(wait));
            }
            // Look again soon all the same (a wake-up can go to a caller
            // that has just stopped waiting), keeping this caller's place
            // unless it was woken.
            let step = (until - now).min(Duration::from_millis(50));
            if tokio::time::timeout(step, freed.as_mut()).await.is_ok() {
                freed.set(self.idle.freed_async.notified());
                freed.as_mut().enable();
            }
        }
    }

    fn all_busy(&self, waited: Duration) -> StoreError {
        StoreError::Unreachable(format!(
            "all {} connections of the {} pool to {} are busy or stalled (waited {} ms)",
            self.limits.max_connections,
            self.name,
            self.target.redacted,
            waited.as_millis()
        ))
    }

    /// An idle connection, if one is free now (no wait, no new connection),
    /// for [`Pooled::run`]; each of its calls waits at most the pool's
    /// call deadline.
    fn idle_now(&self) -> Option<Pooled<'_>> {
        let mut idle = self.idle.conns.lock().unwrap_or_else(|e| e.into_inner());
        self.take_idle(&mut idle, self.limits.call_deadline)
    }

    /// The most recently used of the `idle` connections (those idle longer
    /// than the idle timeout are dropped), its calls bounded by `deadline`.
    fn take_idle(&self, idle: &mut Vec<PgConn>, deadline: Duration) -> Option<Pooled<'_>> {
        while let Some(mut c) = idle.pop() {
            if c.idle_since.elapsed() < self.idle.timeout {
                c.deadline = deadline;
                return Some(Pooled {
                    pool: self,
                    conn: Some(c),
                });
            }
        }
        None
    }

    fn reserve(&self) -> Option<Slot> {
        let max = self.limits.max_connections;
        self.threads
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot {
                threads: self.threads.clone(),
                stalls: self.stalls.clone(),
                freed: self.idle.freed_async.clone(),
                state: Arc::new(AtomicU8::new(RUNNING)),
            })
    }

    /// How many calls (or connects) gave up waiting for the server and still
    /// wait: while there are any, the server (or the way to it) is stalled,
    /// even if a new connection happens to answer.
    /// A thread waits on until the server answers or its connection fails
    /// (keepalives end one to a vanished peer).
    pub fn stalled_calls(&self) -> usize {
        self.stalls.load(Ordering::SeqCst)
    }

    pub fn limits(&self) -> PgLimits {
        self.limits
    }
}

/// A pool's idle connections, most recently used last, and how a caller
/// waiting for one is told that one is back.
struct Idle {
    conns: Mutex<Vec<PgConn>>,
    freed: Condvar,
    /// As `freed`, for callers that wait on an async runtime ([`PgPool::get_async`]).
    /// Also woken when a connection's thread ends (its slot is free).
    freed_async: Arc<tokio::sync::Notify>,
    /// A connection idle longer than this is closed, not used again.
    timeout: Duration,
}

impl Idle {
    fn put(&self, mut c: PgConn) {
        // A stalled connection, or one whose thread ended (a panic in a
        // function run on it), is never used again.
        if c.stalled || c.state.load(Ordering::SeqCst) == ENDED {
            return;
        }
        c.idle_since = Instant::now();
        let mut idle = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        idle.retain(|c| c.idle_since.elapsed() < self.timeout);
        idle.push(c);
        drop(idle);
        self.freed.notify_one();
        self.freed_async.notify_one();
    }
}

/// A connection being opened for [`PgPool::get_async`]'s caller. Dropped
/// with the caller before the caller took it (sent just before the caller
/// was cancelled), the connection goes to the idle ones, as one the opening
/// thread could not send does.
struct Opening {
    opened: tokio::sync::oneshot::Receiver<Result<PgConn>>,
    idle: Arc<Idle>,
}

impl Drop for Opening {
    fn drop(&mut self) {
        // Closed first: from then on the thread keeps what it has not sent.
        self.opened.close();
        if let Ok(Ok(conn)) = self.opened.try_recv() {
            self.idle.put(conn);
        }
    }
}

/// A connection taken from a [`PgPool`], given back when dropped (unless it
/// stalled).
pub(crate) struct Pooled<'a> {
    pool: &'a PgPool,
    conn: Option<PgConn>,
}

impl Pooled<'_> {
    fn conn(&mut self) -> &mut PgConn {
        self.conn.as_mut().expect("a pooled connection")
    }
    /// [`PgConn::run`] on this connection.
    pub async fn run<T: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut dyn Db) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.conn().run(f).await
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            self.pool.idle.put(c);
        }
    }
}

impl Db for Pooled<'_> {
    fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<SqlRow>> {
        self.conn().query(sql, params)
    }
    fn execute(&mut self, sql: &str, params: &[Value]) -> Result<u64> {
        self.conn().execute(sql, params)
    }
    fn batch(&mut self, sql: &str) -> Result<()> {
        self.conn().batch(sql)
    }
    fn dialect(&self) -> Dialect {
        Dialect::Postgres
    }
}

fn failure(e: postgres::Error) -> PgFailure {
    // An error that is not the server's is the connection's (I/O, closed).
    let code = match e.code() {
        Some(c) => Some(c.code().to_string()),
        None if e.as_db_error().is_none() => Some("08000".to_string()),
        None => None,
    };
    // `Display` of a server error is only "db error"; the detail is in the source.
    let message = match e.as_db_error() {
        Some(db) => format!("{}: {}", db.severity(), db.message()),
        None => {
            let mut m = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                m = format!("{m}: {s}");
                src = s.source();
            }
            m
        }
    };
    PgFailure { code, message }
}

fn params(p: &[Value]) -> Vec<&(dyn postgres::types::ToSql + Sync)> {
    p.iter()
        .map(|v| v as &(dyn postgres::types::ToSql + Sync))
        .collect()
}

fn worker(
    config: postgres::Config,
    tls: tokio_postgres_rustls::MakeRustlsConnect,
    limits: PgLimits,
    secret: Option<String>,
    rx: mpsc::Receiver<Job>,
    ready: mpsc::SyncSender<std::result::Result<(), PgFailure>>,
) {
    let connect = |config: &postgres::Config| -> std::result::Result<postgres::Client, PgFailure> {
        let mut c = match config.connect(tls.clone()) {
            Ok(c) => c,
            // libpq's `prefer`: a server whose TLS this client cannot use (an old
            // protocol version, an unsupported key) is used in the clear, as
            // before TLS was built. The other modes never fall back.
            Err(e)
                if config.get_ssl_mode() == postgres::config::SslMode::Prefer
                    && e.to_string().contains("TLS") =>
            {
                tracing::warn!(error = %e, "the PostgreSQL server's TLS failed; sslmode=prefer: connecting without TLS");
                let mut plain = config.clone();
                plain.ssl_mode(postgres::config::SslMode::Disable);
                plain.connect(tls.clone()).map_err(failure)?
            }
            Err(e) => return Err(failure(e)),
        };
        c.batch_execute(&format!(
            "SET lock_timeout = '{}ms'; SET statement_timeout = '{}ms'; \
             SET idle_in_transaction_session_timeout = '{}ms'",
            limits.lock_wait.as_millis(),
            limits.statement_timeout.as_millis(),
            limits.statement_timeout.as_millis(),
        ))
        .map_err(failure)?;
        Ok(c)
    };
    let client = match connect(&config) {
        Ok(c) => {
            let _ = ready.send(Ok(()));
            c
        }
        Err(f) => {
            let _ = ready.send(Err(f));
            return;
        }
    };
    let mut session = Session {
        client,
        statements: HashMap::new(),
        in_tx: false,
    };
    while let Ok(job) = rx.recv() {
        // A server restart closes the connection: outside a transaction, open a
        // new one rather than failing every call from now on. A failed
        // reconnect is the answer to each statement of the job, so that the
        // caller hears why (the server refused, or is not there), not only
        // that the connection is closed.
        let mut down = None;
        if session.client.is_closed() && !session.in_tx {
            match connect(&config) {
                Ok(c) => {
                    session.client = c;
                    session.statements.clear();
                }
                Err(f) => down = Some(f),
            }
        }
        match job {
            Job::Call(req, reply) => {
                let _ = reply.send(match down {
                    Some(f) => Err(f),
                    None => session.serve(&req),
                });
            }
            Job::Run(f) => f(&mut Direct {
                session: &mut session,
                secret: secret.as_deref(),
                sent: 0,
                down,
            }),
        }
    }
}

/// A connection's client on its own thread, with its prepared statements.
struct Session {
    client: postgres::Client,
    statements: HashMap<String, postgres::Statement>,
    in_tx: bool,
}

impl Session {
    fn prepared(&mut self, sql: &str) -> std::result::Result<postgres::Statement, PgFailure> {
        if let Some(st) = self.statements.get(sql) {
            return Ok(st.clone());
        }
        let st = self.client.prepare(sql).map_err(failure)?;
        self.statements.insert(sql.to_string(), st.clone());
        Ok(st)
    }

    fn serve(&mut self, req: &Req) -> Reply {
        match req {
            Req::Query(sql, p) => {
                let st = self.prepared(sql)?;
                let rows = self.client.query(&st, &params(p)).map_err(failure)?;
                rows.iter()
                    .map(pg_row)
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map(Answer::Rows)
                    .map_err(|message| PgFailure {
                        code: None,
                        message,
                    })
            }
            Req::Execute(sql, p) => {
                let st = self.prepared(sql)?;
                self.client
                    .execute(&st, &params(p))
                    .map(Answer::Count)
                    .map_err(failure)
            }
            Req::Batch(sql) => {
                let t = sql.trim_start().to_ascii_uppercase();
                if t.starts_with("BEGIN") {
                    self.in_tx = true;
                } else if t.starts_with("COMMIT") || t.starts_with("ROLLBACK") {
                    self.in_tx = false;
                }
                // DDL may change what a prepared statement refers to.
                if !t.starts_with("BEGIN") && !t.starts_with("COMMIT") && !t.starts_with("ROLLBACK")
                {
                    self.statements.clear();
                }
                self.client
                    .batch_execute(sql)
                    .map(|_| Answer::Done)
                    .map_err(failure)
            }
        }
    }
}

/// The connection as a function run on its thread sees it ([`PgConn::run`]):
/// each statement straight to the server. It counts each statement for the
/// process as it sends it, and how many it sent for the caller, whose thread
/// they are counted on when the answer comes.
struct Direct<'a> {
    session: &'a mut Session,
    secret: Option<&'a str>,
    sent: u64,
    /// Why the connection could not be opened again before this job: each
    /// statement fails with it, unsent.
    down: Option<PgFailure>,
}

impl Serve for Direct<'_> {
    fn serve(&mut self, req: Req) -> Result<Answer> {
        if let Some(f) = &self.down {
            return Err(store_error(f.clone(), self.secret));
        }
        // For the process here, as it is sent: a caller that stopped
        // waiting (a timeout, a cancel) still leaves it counted.
        STATEMENTS.fetch_add(1, Ordering::Relaxed);
        self.sent += 1;
        self.session
            .serve(&req)
            .map_err(|f| store_error(f, self.secret))
    }
}

/// The URL with its password (in the user info or a `password=` parameter)
/// replaced by `***`.
pub(crate) fn redact_url(url: &str) -> String {
    let mut out = url.to_string();
    if let Some(p) = password_of(url) {
        out = out.replace(&format!(":{p}@"), ":***@");
    }
    if let Some(q) = out.find('?') {
        let (head, query) = out.split_at(q + 1);
        let query: Vec<String> = query
            .split('&')
            .map(|kv| {
                if kv.to_ascii_lowercase().starts_with("password=") {
                    "password=***".to_string()
                } else {
                    kv.to_string()
                }
            })
            .collect();
        out = format!("{head}{}", query.join("&"));
    }
    out
}

/// The password in `scheme://user:password@host...`, as written. The user
/// info ends at the first `@` (a raw `@` cannot be in it), so a password with
/// a raw `/` or `?` is still found and masked; at worst, a URL without user
/// info but with an `@` in its query has more masked than needed.
pub(crate) fn password_of(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let userinfo = rest.split_once('@')?.0;
    let pw = userinfo.split_once(':')?.1;
    (!pw.is_empty()).then(|| pw.to_string())
}

/// Removes the password from a message, should a driver ever echo it.
fn scrub(message: &str, secret: Option<&str>) -> String {
    match secret {
        Some(s) if !s.is_empty() => message.replace(s, "***"),
        _ => message.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool on the tests' PostgreSQL server, if there is one (a printed
    /// skip otherwise, see [`crate::store_testing::postgres_admin_url`]).
    fn test_pool(test: &str) -> Option<PgPool> {
        let url = crate::store_testing::postgres_admin_url(test)?;
        let target = PgTarget::parse(&url).unwrap();
        Some(PgPool::new(
            target,
            PgLimits::new(Duration::from_secs(2)),
            "store",
        ))
    }

    #[test]
    fn a_statement_refused_on_a_stalled_connection_is_not_counted_as_sent() {
        let Some(pool) =
            test_pool("sqldb::a_statement_refused_on_a_stalled_connection_is_not_counted_as_sent")
        else {
            return;
        };
        let wait = Duration::from_secs(10);
        let mut conn = pool.get(wait, wait).unwrap();
        let before = statements_sent_here();
        conn.batch("SELECT 1").unwrap();
        assert_eq!(statements_sent_here() - before, 1);
        // As after a call that outlived its deadline: the ROLLBACK that
        // follows is refused at once, never sent.
        conn.conn().stalled = true;
        let before = statements_sent_here();
        assert!(conn.batch("ROLLBACK").is_err());
        assert_eq!(statements_sent_here(), before);
    }

    #[tokio::test]
    async fn a_connection_opened_for_a_caller_that_stopped_waiting_is_kept() {
        let Some(pool) =
            test_pool("sqldb::a_connection_opened_for_a_caller_that_stopped_waiting_is_kept")
        else {
            return;
        };
        let wait = Duration::from_secs(10);
        // Polled once (no idle connection: it starts opening one), then
        // dropped, as an evaluation cancelled while it waits.
        let mut caller = Box::pin(pool.get_async(wait));
        tokio::select! {
            biased;
            _ = &mut caller => panic!("a new connection cannot be open at the first poll"),
            _ = std::future::ready(()) => {}
        }
        drop(caller);
        assert_eq!(
            pool.threads.load(Ordering::SeqCst),
            1,
            "one connection opening"
        );
        let until = Instant::now() + wait;
        while pool.idle.conns.lock().unwrap().is_empty() {
            assert!(Instant::now() < until, "no connection kept within {wait:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The next caller takes it: no second connection.
        let mut next = pool.get_async(wait).await.unwrap();
        let answered = next.run(|db| db.one("SELECT 1", &[]).map(|r| r.is_some()));
        assert!(answered.await.unwrap());
        assert_eq!(pool.threads.load(Ordering::SeqCst), 1);

        // Sent to the caller just before it was cancelled: kept all the same.
        let conn = next.conn.take().expect("a connection");
        assert!(pool.idle.conns.lock().unwrap().is_empty());
        let (sent, opened) = tokio::sync::oneshot::channel();
        assert!(sent.send(Ok(conn)).is_ok());
        drop(Opening {
            opened,
            idle: pool.idle.clone(),
        });
        assert_eq!(pool.idle.conns.lock().unwrap().len(), 1);
    }

    #[test]
    fn a_password_with_a_raw_slash_or_question_mark_is_masked() {
        let url = "postgres://lb:pa/ss?w@db.example:5432/lb";
        assert_eq!(password_of(url).as_deref(), Some("pa/ss?w"));
        assert_eq!(redact_url(url), "postgres://lb:***@db.example:5432/lb");
        assert_eq!(
            password_of("postgres://db.example/lb?sslmode=require"),
            None
        );
    }

    #[test]
    fn placeholders_become_dollars_outside_literals() {
        assert_eq!(
            pg_placeholders("SELECT '?1', x FROM t WHERE a = ?1 AND b = ?12 AND c = '?'"),
            "SELECT '?1', x FROM t WHERE a = $1 AND b = $12 AND c = '?'"
        );
    }

    #[test]
    fn ddl_uses_bigint_identity_and_byte_order() {
        let d = pg_ddl(
            "CREATE TABLE e (id INTEGER PRIMARY KEY AUTOINCREMENT, n INTEGER NOT NULL, s TEXT)",
        );
        assert_eq!(
            d,
            "CREATE TABLE e (id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, n BIGINT NOT NULL, s TEXT COLLATE \"C\")"
        );
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://u:s3cr%40t@db.example:5432/lb?sslmode=disable"),
            "postgres://u:***@db.example:5432/lb?sslmode=disable"
        );
        assert_eq!(
            redact_url("postgresql://u@h/db?password=hunter2&x=1"),
            "postgresql://u@h/db?password=***&x=1"
        );
        assert_eq!(redact_url("postgres://h/db"), "postgres://h/db");
        assert_eq!(scrub("bad hunter2 here", Some("hunter2")), "bad *** here");
    }
}
