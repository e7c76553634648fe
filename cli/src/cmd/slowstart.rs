//! `lbscale slowstart FILE|-`: request rates of each service under slow start.

use crate::output::{file_argument, print_json, read_json, CliError};

/// Runs the command.
pub fn run(args: &[String]) -> Result<(), CliError> {
    let file = file_argument("slowstart", args)?;
    let doc = read_json(&file)?;
    let out = lbscale_core::slowstart::simulate_json(&doc)?;
    print_json(&out)
}
