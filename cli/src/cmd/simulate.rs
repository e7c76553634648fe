//! `lbscale simulate FILE|-`: the timeline the daemon would produce for a metric trace.

use crate::output::{file_argument, print_json, read_json, CliError};

/// Runs the command.
pub fn run(args: &[String]) -> Result<(), CliError> {
    let file = file_argument("simulate", args)?;
    let doc = read_json(&file)?;
    let out = lbscale_core::simulate::simulate_json(&doc)?;
    print_json(&out)
}
