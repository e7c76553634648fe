//! `lbscale status --state URL`: every group of the store with its nodes per AZ,
//! as a table (what the store and the node processes show now), and each AZ's
//! policy phase as the daemon last persisted it (with the end of a cooldown or
//! back-off it waits for); then, for groups behind an `nlb`, each vserver's span
//! per AZ and the nodes that hold it.

use lbscale_cloud_aws::AwsSettings;
use lbscale_cloud_local::LocalSettings;
use lbscale_engine::Engine;

use crate::cmd::daemon::{check_state_url, flag_pairs, state_url};
use crate::cmd::events::format_time;
use crate::output::CliError;
use lbscale_daemon::group::phase_name;
use lbscale_daemon::resume::wait_ends_at;

pub fn run(args: &[String]) -> Result<(), CliError> {
    let mut state = None;
    for (flag, value) in flag_pairs(args, "--state")? {
        match flag.as_str() {
            "--state" => {
                check_state_url(&value)?;
                state = Some(value)
            }
            other => {
                return Err(CliError::Usage(format!(
                    "{other}: must be --state, got an unknown argument"
                )))
            }
        }
    }
    let state = state_url(state)?;
    let cwd =
        std::env::current_dir().map_err(|e| CliError::Output(format!("current directory: {e}")))?;
    // Each node's state is asked of its cloud, as the provider and the daemon do.
    let clouds = lbscale_engine::cloud::Clouds::new()
        .with(
            "local",
            lbscale_cloud_local::drivers(LocalSettings::default()),
        )
        .with("aws", lbscale_cloud_aws::drivers(AwsSettings::from_env()))
        .with(
            "azure",
            lbscale_cloud_azure::drivers(lbscale_cloud_azure::AzureSettings::from_env()),
        )
        .with(
            "gcp",
            lbscale_cloud_gcp::drivers(lbscale_cloud_gcp::GcpSettings::from_env()),
        );
    let engine = Engine::open(&state, &cwd, clouds)
        .map_err(|e| CliError::Output(format!("--state: {e}")))?;
    let groups = engine
        .all_groups()
        .map_err(|e| CliError::Output(e.to_string()))?;
    let mut rows = vec![[
        "GROUP", "AZ", "MIN", "MAX", "SERVING", "NODES", "STATUS", "POLICY",
    ]
    .map(String::from)
    .to_vec()];
    // Whether a node runs is the cloud's answer (an API call outside `local`).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Output(format!("starting the runtime: {e}")))?;
    for g in &groups {
        let Some(view) = rt
            .block_on(engine.group_view(&g.id))
            .map_err(|e| CliError::Output(e.to_string()))?
        else {
            continue;
        };
        let status = view.status();
        let policy = engine
            .policy_states(&g.id)
            .map_err(|e| CliError::Output(e.to_string()))?;
        for az in &view.spec.availability_zones {
            let nodes: Vec<_> = view
                .nodes
                .iter()
                .filter(|n| &n.availability_zone == az)
                .collect();
            let serving = nodes.iter().filter(|n| n.serving).count();
            let mut by_state = std::collections::BTreeMap::<&str, usize>::new();
            for n in &nodes {
                *by_state.entry(n.state.as_str()).or_default() += 1;
            }
            let states = if by_state.is_empty() {
                "-".to_string()
            } else {
                by_state
                    .iter()
                    .map(|(s, n)| format!("{n} {s}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            rows.push(vec![
                g.spec.name.clone(),
                az.clone(),
                g.spec.min_nodes.to_string(),
                g.spec.max_nodes.to_string(),
                serving.to_string(),
                states,
                status.clone(),
                policy
                    .iter()
                    .find(|p| &p.az == az)
                    .map(|p| {
                        let phase = phase_name(p.state.phase.kind());
                        match wait_ends_at(&p.state.phase) {
                            Some(until) => format!("{phase} until {}", format_time(until as i64)),
                            None => phase.to_string(),
                        }
                    })
                    // No daemon has evaluated the AZ yet.
                    .unwrap_or_else(|| "-".into()),
            ]);
        }
    }
    print_table(&rows);
    if groups.is_empty() {
        println!("(no autoscale groups in the store)");
    }
    // Behind an nlb: how many nodes hold each vserver (the daemon sizes it).
    let mut spans = vec![["VSERVER", "GROUP", "AZ", "SPAN", "MIN", "MAX", "HOLDERS"]
        .map(String::from)
        .to_vec()];
    for g in &groups {
        for v in engine
            .vserver_spans(&g.id)
            .map_err(|e| CliError::Output(e.to_string()))?
        {
            spans.push(vec![
                v.vserver,
                g.spec.name.clone(),
                v.az,
                v.span.to_string(),
                v.min.to_string(),
                v.max.to_string(),
                if v.holders.is_empty() {
                    "-".into()
                } else {
                    v.holders.join(", ")
                },
            ]);
        }
    }
    if spans.len() > 1 {
        println!();
        print_table(&spans);
    }
    Ok(())
}

/// Prints rows as columns separated by two spaces (the last column unpadded).
pub fn print_table(rows: &[Vec<String>]) {
    let cols = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c + 1 == r.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<w$}  ", w = widths[c]));
            }
        }
        println!("{}", line.trim_end());
    }
}
