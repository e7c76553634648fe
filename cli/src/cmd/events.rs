//! `lbscale events --state URL [--group NAME] [--limit N]`: the recorded events
//! (decisions and workflow steps), oldest first, as a table.

use lbscale_engine::cloud::Clouds;
use lbscale_engine::{Engine, EngineError};

use crate::cmd::daemon::{check_state_url, flag_pairs, state_url};
use crate::cmd::status::print_table;
use crate::output::CliError;

pub fn run(args: &[String]) -> Result<(), CliError> {
    let mut state = None;
    let mut group = None;
    let mut limit = 200usize;
    for (flag, value) in flag_pairs(args, "--state, --group, --limit")? {
        match flag.as_str() {
            "--state" => {
                check_state_url(&value)?;
                state = Some(value)
            }
            "--group" => group = Some(value),
            "--limit" => {
                limit = value.parse().ok().filter(|n| *n >= 1).ok_or_else(|| {
                    CliError::Usage(format!(
                        "--limit: must be a whole number from 1, got {value:?}"
                    ))
                })?
            }
            other => {
                return Err(CliError::Usage(format!(
                    "{other}: must be one of --state, --group, --limit, got an unknown argument"
                )))
            }
        }
    }
    let state = state_url(state)?;
    let cwd =
        std::env::current_dir().map_err(|e| CliError::Output(format!("current directory: {e}")))?;
    // Events need no cloud: the engine opens the store alone.
    let engine = Engine::open(&state, &cwd, Clouds::new())
        .map_err(|e| CliError::Output(format!("--state: {e}")))?;
    let out = |e: EngineError| CliError::Output(e.to_string());
    let groups = match &group {
        Some(name) => vec![engine.group_named(name).map_err(out)?.ok_or_else(|| {
            CliError::Usage(format!(
                "--group: must name an autoscale group of the store, got {name:?}"
            ))
        })?],
        None => engine.all_groups().map_err(out)?,
    };
    let mut events = Vec::new();
    for g in &groups {
        for e in engine.events(&g.id, limit).map_err(out)? {
            events.push((g.spec.name.clone(), e));
        }
    }
    events.sort_by_key(|(_, e)| e.time_ms);
    // Repeats of an event (same AZ, kind and reason, in a row) are one row:
    // COUNT says how many, and when the last one was.
    let mut rows = vec![["TIME", "GROUP", "AZ", "KIND", "COUNT", "REASON"]
        .map(String::from)
        .to_vec()];
    for (name, e) in events {
        rows.push(vec![
            format_time(e.time_ms),
            name,
            e.az.unwrap_or_else(|| "-".into()),
            e.kind,
            if e.count > 1 {
                format!("{} (last {})", e.count, format_time(e.last_ms))
            } else {
                "1".into()
            },
            e.reason,
        ]);
    }
    print_table(&rows);
    Ok(())
}

/// `2024-05-01T12:00:00.123Z` from Unix ms (UTC, no time-zone database needed).
pub(crate) fn format_time(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms.rem_euclid(1000)
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats_utc_times() {
        assert_eq!(super::format_time(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            super::format_time(1_714_564_800_123),
            "2024-05-01T12:00:00.123Z"
        );
    }
}
