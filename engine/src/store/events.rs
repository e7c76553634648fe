//! Events: what happened to a group, kept per group within a retention.

use super::*;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Unix ms of its first occurrence.
    pub time_ms: i64,
    pub group_id: String,
    pub az: Option<String>,
    pub kind: String,
    pub reason: String,
    /// How many times it happened in a row (the same AZ, kind and reason).
    #[serde(default = "one")]
    pub count: u64,
    /// Unix ms of its last occurrence (`time_ms` when `count` is 1).
    #[serde(default)]
    pub last_ms: i64,
}

fn one() -> u64 {
    1
}

/// How many events the store keeps per group: those whose last occurrence is
/// younger than `max_age`, and of those the newest `max_per_group`. Applied to
/// a group at each of its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventRetention {
    pub max_per_group: u64,
    pub max_age: Duration,
}

/// [`EventRetention::max_per_group`] from the environment.
pub const EVENTS_MAX_PER_GROUP_ENV: &str = "LBSCALE_EVENTS_MAX_PER_GROUP";
/// [`EventRetention::max_age`] from the environment.
pub const EVENTS_MAX_AGE_ENV: &str = "LBSCALE_EVENTS_MAX_AGE";

impl Default for EventRetention {
    fn default() -> Self {
        EventRetention {
            max_per_group: 1000,
            max_age: Duration::from_secs(30 * 24 * 3600),
        }
    }
}

impl EventRetention {
    /// The defaults, with [`EVENTS_MAX_PER_GROUP_ENV`] and [`EVENTS_MAX_AGE_ENV`]
    /// where set and not blank; a bad value is refused naming the variable.
    pub fn from_env() -> Result<EventRetention> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        EventRetention::parse(
            var(EVENTS_MAX_PER_GROUP_ENV).as_deref(),
            var(EVENTS_MAX_AGE_ENV).as_deref(),
        )
    }

    /// As [`EventRetention::from_env`], from the two values.
    pub fn parse(max_per_group: Option<&str>, max_age: Option<&str>) -> Result<EventRetention> {
        let mut r = EventRetention::default();
        let bad = |detail: String| StoreError::Setting(detail);
        if let Some(v) = max_per_group {
            r.max_per_group = match v.trim().parse::<u64>() {
                Ok(n) if (1..=1_000_000).contains(&n) => n,
                _ => {
                    return Err(bad(format!(
                        "{EVENTS_MAX_PER_GROUP_ENV}: must be a whole number from 1 to 1000000, got {v:?}"
                    )))
                }
            };
        }
        if let Some(v) = max_age {
            r.max_age = match lbscale_core::duration::parse_duration(v) {
                Ok(d) if d >= Duration::from_secs(60) => d,
                Ok(_) => {
                    return Err(bad(format!(
                        "{EVENTS_MAX_AGE_ENV}: must be at least 1m, got {v:?}"
                    )))
                }
                Err(e) => return Err(bad(format!("{EVENTS_MAX_AGE_ENV}: {e}"))),
            };
        }
        Ok(r)
    }
}

impl Store {
    /// Records an event of the group. The same event again (same AZ, kind and
    /// reason as the group's latest) raises that row's `count` and `last_ms`
    /// instead of adding a row; then the group's events past the retention
    /// ([`EventRetention`]: by age of their last occurrence, then by count,
    /// oldest first) are deleted.
    pub fn record_event(
        &self,
        group_id: &str,
        az: Option<&str>,
        kind: &str,
        reason: &str,
    ) -> Result<()> {
        let (now, keep) = (self.now(), self.event_retention());
        self.with(|c| event_recorded_in(c, group_id, az, kind, reason, now, keep))
    }

    /// As [`Store::record_event`], for a caller on an async runtime (see
    /// [`Store::with_async`]).
    pub async fn record_event_async(
        &self,
        group_id: &str,
        az: Option<&str>,
        kind: &str,
        reason: &str,
    ) -> Result<()> {
        let (now, keep) = (self.now(), self.event_retention());
        let (group_id, az) = (group_id.to_string(), az.map(str::to_string));
        let (kind, reason) = (kind.to_string(), reason.to_string());
        self.with_async(move |c| {
            event_recorded_in(c, &group_id, az.as_deref(), &kind, &reason, now, keep)
        })
        .await
    }
    /// The most recent `limit` events of the group, oldest first.
    pub fn events_of_group(&self, group_id: &str, limit: usize) -> Result<Vec<Event>> {
        let rows = self.with(|c| {
            c.query(
                "SELECT time_ms, group_id, az, kind, reason, count, last_ms FROM events
                 WHERE group_id = ?1 ORDER BY id DESC LIMIT ?2",
                vals![group_id, limit as i64],
            )
        })?;
        let mut out = rows
            .into_iter()
            .map(|r| {
                Ok(Event {
                    time_ms: r.int(0)?,
                    group_id: r.text(1)?,
                    az: r.opt_text(2)?,
                    kind: r.text(3)?,
                    reason: r.text(4)?,
                    count: r.int(5)?.max(1) as u64,
                    last_ms: r.int(6)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        out.reverse();
        Ok(out)
    }
}

/// [`Store::record_event`]'s statements, on `c`, at `now` (the store's clock).
fn event_recorded_in(
    c: &mut dyn Db,
    group_id: &str,
    az: Option<&str>,
    kind: &str,
    reason: &str,
    now: i64,
    keep: EventRetention,
) -> Result<()> {
    let latest = c.one(
        "SELECT id, az, kind, reason FROM events WHERE group_id = ?1 ORDER BY id DESC LIMIT 1",
        vals![group_id],
    )?;
    let repeat = match latest {
        Some(r)
            if r.opt_text(1)?.as_deref() == az && r.text(2)? == kind && r.text(3)? == reason =>
        {
            Some(r.int(0)?)
        }
        _ => None,
    };
    match repeat {
        Some(id) => c.execute(
            "UPDATE events SET count = count + 1, last_ms = ?2 WHERE id = ?1",
            vals![id, now],
        )?,
        None => c.execute(
            "INSERT INTO events (time_ms, last_ms, count, group_id, az, kind, reason)
             VALUES (?1, ?1, 1, ?2, ?3, ?4, ?5)",
            vals![now, group_id, az, kind, reason],
        )?,
    };
    let oldest_kept = now.saturating_sub(keep.max_age.as_millis() as i64);
    c.execute(
        "DELETE FROM events WHERE group_id = ?1 AND last_ms < ?2",
        vals![group_id, oldest_kept],
    )?;
    c.execute(
        "DELETE FROM events WHERE group_id = ?1 AND id <= (
           SELECT id FROM events WHERE group_id = ?1 ORDER BY id DESC LIMIT 1 OFFSET ?2)",
        vals![group_id, keep.max_per_group as i64],
    )?;
    Ok(())
}
