//! What every command shares: reading the JSON input, printing JSON, failing well.

use std::io::{Read, Write};

use lbscale_core::error::ConfigError;
use serde::Serialize;

/// Why a command failed; decides the exit status.
#[derive(Debug)]
pub enum CliError {
    /// Bad command line (exit 2).
    Usage(String),
    /// Invalid input document (exit 2).
    Input(ConfigError),
    /// The input could not be read or parsed as JSON (exit 2).
    Unreadable(String),
    /// Writing the output failed (exit 1).
    Output(String),
}

impl CliError {
    /// The one-line message, without the `error: ` prefix.
    pub fn message(&self) -> String {
        let text = match self {
            CliError::Usage(m) | CliError::Unreadable(m) | CliError::Output(m) => m.clone(),
            CliError::Input(e) => e.to_string(),
        };
        // One line, whatever a nested message contained.
        text.replace(['\n', '\r'], " ")
    }

    /// 2 for anything the caller got wrong, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Output(_) => 1,
            _ => 2,
        }
    }
}

impl From<ConfigError> for CliError {
    fn from(e: ConfigError) -> Self {
        CliError::Input(e)
    }
}

/// Takes the single `FILE|-` argument of a command.
pub fn file_argument(command: &str, args: &[String]) -> Result<String, CliError> {
    match args {
        [file] if file != "--help" && file != "-h" => Ok(file.clone()),
        [] => Err(CliError::Usage(format!(
            "FILE: must be a JSON file or - for standard input (lbscale {command} FILE|-), got nothing"
        ))),
        _ => Err(CliError::Usage(format!(
            "arguments: must be exactly one FILE or - (lbscale {command} FILE|-), got {:?}",
            args.join(" ")
        ))),
    }
}

/// Reads and parses the JSON document named by `file` (`-`: standard input).
pub fn read_json(file: &str) -> Result<serde_json::Value, CliError> {
    let mut text = String::new();
    let read = if file == "-" {
        std::io::stdin().read_to_string(&mut text).map(|_| ())
    } else {
        std::fs::File::open(file).and_then(|mut f| f.read_to_string(&mut text).map(|_| ()))
    };
    let name = if file == "-" { "standard input" } else { file };
    read.map_err(|e| CliError::Unreadable(format!("{name}: must be a readable file, got {e}")))?;
    serde_json::from_str(&text)
        .map_err(|e| CliError::Unreadable(format!("{name}: must be a JSON document, got {e}")))
}

/// Prints `value` as one line of JSON with `", "` and `": "` separators, the layout
/// of docs/cli.md's examples, followed by a newline.
pub fn print_json<T: Serialize>(value: &T) -> Result<(), CliError> {
    let mut buf = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, SpacedFormatter);
    value
        .serialize(&mut ser)
        .map_err(|e| CliError::Output(format!("output: must serialise, got {e}")))?;
    buf.push(b'\n');
    print_raw(&buf)
}

/// Writes bytes to standard output.
pub fn print_raw(bytes: &[u8]) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    out.write_all(bytes)
        .and_then(|_| out.flush())
        .map_err(|e| CliError::Output(format!("standard output: must be writable, got {e}")))
}

/// Compact JSON with a space after `,` and `:`.
struct SpacedFormatter;

impl serde_json::ser::Formatter for SpacedFormatter {
    fn begin_array_value<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}
