//! Argument parsers and output helpers shared by the subcommands.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Parses `KEY=VALUE` (the value may be empty and may contain `=`).
pub fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// Parses a byte size: a plain number of bytes or one with a binary unit
/// (`K`, `M`, `G`, `T`, optionally followed by `B` or `iB`; case-insensitive).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let unit = unit
        .strip_suffix("ib")
        .or_else(|| unit.strip_suffix('b'))
        .unwrap_or(&unit);
    let shift = match unit {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return Err(format!("unknown size unit in {s:?} (use e.g. 512M or 2G)")),
    };
    let bad = || format!("bad size {s:?} (use e.g. 1073741824, 512M or 2G)");
    if num.is_empty() {
        return Err(bad());
    }
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(1u64 << shift).ok_or_else(bad);
    }
    let f: f64 = num.parse().map_err(|_| bad())?;
    let bytes = f * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes.round() as u64)
}

/// Parses a duration: a number with `ms`, `s`, `m`, `h` or `d` (plain numbers are seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let secs_per_unit = match unit.trim() {
        "" | "s" | "sec" | "secs" => 1.0,
        "ms" => 0.001,
        "m" | "min" | "mins" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        _ => {
            return Err(format!(
                "unknown duration unit in {s:?} (use e.g. 500ms, 30s, 5m, 1h)"
            ));
        }
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("bad duration {s:?} (use e.g. 500ms, 30s, 5m, 1h)"))?;
    Duration::try_from_secs_f64(n * secs_per_unit)
        .map_err(|_| format!("duration {s:?} is out of range"))
}

/// Current wall-clock time in unix milliseconds.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// A short human duration: `45s`, `4m 59s`, `2h 3m`, `3d 4h`.
pub fn human_duration(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    let (d, h, m, sec) = (s / 86400, s / 3600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        format!("{d}d {h}h")
    } else if h > 0 {
        format!("{h}h {m}m")
    } else if m > 0 {
        format!("{m}m {sec}s")
    } else {
        format!("{sec}s")
    }
}

/// How far in the future `at_ms` is (`expired` if it is past).
pub fn time_until(at_ms: i64) -> String {
    let left = at_ms - now_ms();
    if left <= 0 {
        "expired".to_string()
    } else {
        human_duration(left)
    }
}

/// How long ago `at_ms` was.
pub fn time_since(at_ms: i64) -> String {
    format!("{} ago", human_duration(now_ms() - at_ms))
}

/// A byte count with a binary unit: `512 MiB`, `1.5 GiB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 || value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Prints `value` as pretty JSON on stdout.
pub fn print_json<T: Serialize + ?Sized>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints `value` as one line of compact JSON (a line of NDJSON) on stdout.
pub fn print_json_line<T: Serialize + ?Sized>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string(value)?);
    Ok(())
}

/// Prints `NAME  value` lines with the values in one column (the detail view of one
/// resource).
pub fn print_fields<N: AsRef<str>>(fields: &[(N, String)]) {
    let width = fields
        .iter()
        .map(|(n, _)| n.as_ref().chars().count())
        .max()
        .unwrap_or(0);
    for (name, value) in fields {
        println!("{:<width$}  {value}", name.as_ref());
    }
}

/// Prints rows as plain columns separated by two spaces, under a header.
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        println!("{}", out.trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("1gib"), Ok(1 << 30));
        assert_eq!(parse_size("2 GB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5K"), Ok(1536));
        assert!(parse_size("").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn key_values() {
        assert_eq!(parse_key_value("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert_eq!(parse_key_value("A="), Ok(("A".into(), String::new())));
        assert!(parse_key_value("=x").is_err());
        assert!(parse_key_value("novalue").is_err());
    }

    #[test]
    fn humans() {
        assert_eq!(human_duration(299_500), "4m 59s");
        assert_eq!(human_duration(3 * 86_400_000 + 4 * 3_600_000), "3d 4h");
        assert_eq!(human_bytes(512 << 20), "512 MiB");
        assert_eq!(human_bytes(1536 << 20), "1.5 GiB");
        assert_eq!(human_bytes(100), "100 B");
    }
}
