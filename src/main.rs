//! The `trajlog` command-line tool; see `trajlog --help`.

mod cli;

fn main() {
    std::process::exit(cli::main());
}
