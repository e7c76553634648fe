//! `lbscale se-plan --nodes N [--forwarding-cost X] [--mode native|bgp|native_and_bgp]
//! [--ecmp-paths P]`: capacity and per-node shares of a vserver scaled out over N nodes.

use lbscale_core::seplan::{self, PlanParams, ScalingMode, MAX_NODES};

use crate::output::{print_raw, CliError};

/// Runs the command.
pub fn run(args: &[String]) -> Result<(), CliError> {
    let mut nodes: Option<u32> = None;
    let mut params = PlanParams::default();
    let mut i = 0;
    while i < args.len() {
        let (flag, inline) = match args[i].split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (args[i].clone(), None),
        };
        let value = match inline {
            Some(v) => v,
            None => {
                i += 1;
                args.get(i).cloned().ok_or_else(|| {
                    CliError::Usage(format!("{flag}: must be followed by a value, got nothing"))
                })?
            }
        };
        match flag.as_str() {
            "--nodes" => {
                nodes = Some(
                    value
                        .parse::<u32>()
                        .ok()
                        .filter(|n| (1..=MAX_NODES).contains(n))
                        .ok_or_else(|| {
                            CliError::Usage(format!(
                                "--nodes: must be a whole number from 1 to {MAX_NODES}, got {value:?}"
                            ))
                        })?,
                );
            }
            "--forwarding-cost" => {
                let f = value.parse::<f64>().map_err(|_| {
                    CliError::Usage(format!(
                        "--forwarding-cost: must be a number from 0 to 1, got {value:?}"
                    ))
                })?;
                params.forwarding_cost = seplan::validate_forwarding_cost(f).map_err(|_| {
                    CliError::Usage(format!(
                        "--forwarding-cost: must be a number from 0 to 1, got {value:?}"
                    ))
                })?;
            }
            "--mode" => {
                params.mode = ScalingMode::parse(&value).ok_or_else(|| {
                    CliError::Usage(format!(
                        "--mode: must be one of native, bgp, native_and_bgp, got {value:?}"
                    ))
                })?;
            }
            "--ecmp-paths" => {
                params.ecmp_paths = value
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=MAX_NODES).contains(n))
                    .ok_or_else(|| {
                        CliError::Usage(format!(
                            "--ecmp-paths: must be a whole number from 1 to {MAX_NODES}, got {value:?}"
                        ))
                    })?;
            }
            other => {
                return Err(CliError::Usage(format!(
                    "{other}: must be one of --nodes, --forwarding-cost, --mode, --ecmp-paths, got an unknown argument"
                )))
            }
        }
        i += 1;
    }
    let nodes = nodes.ok_or_else(|| {
        CliError::Usage(format!(
            "--nodes: must be given, a whole number from 1 to {MAX_NODES}, got nothing"
        ))
    })?;
    let plan = seplan::plan(&params, nodes);
    print_raw(render(&plan).as_bytes())
}

/// docs/cli.md's exact layout: capacity with two decimals, shares with three
/// (`{"nodes": 4, "mode": "native", "capacity": 3.10, "shares": [0.032, 0.323, ...]}`).
/// Written by hand because serde_json prints `3.1`, not `3.10`; both are the same JSON
/// number, so tools reading it see no difference.
fn render(plan: &seplan::Plan) -> String {
    let shares: Vec<String> = plan.shares.iter().map(|s| format!("{s:.3}")).collect();
    format!(
        "{{\"nodes\": {}, \"mode\": \"{}\", \"capacity\": {:.2}, \"shares\": [{}]}}\n",
        plan.nodes,
        plan.mode.name(),
        plan.capacity,
        shares.join(", ")
    )
}
