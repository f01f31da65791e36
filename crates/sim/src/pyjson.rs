//! JSON text as rLLM's gateway (Python) writes it: floats as Python's
//! `repr(float)` (the shortest decimal that parses back to the same `f64`,
//! in exponent form below 1e-4 and from 1e16 on, with a two-digit exponent),
//! strings escaped as `json.dumps` escapes ASCII text. The simulator only
//! writes printable ASCII and `\n`, where `json.dumps` and serde_json agree.

use std::fmt::Write as _;

/// Write `v` as Python's `json.dumps` writes a float (`repr`, and `NaN`,
/// `Infinity`, `-Infinity` for the non-finite values).
pub fn write_py_float(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("NaN");
        return;
    }
    if v.is_infinite() {
        out.push_str(if v > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    if v.is_sign_negative() {
        out.push('-');
    }
    if v == 0.0 {
        out.push_str("0.0");
        return;
    }
    // Rust's `{:e}` gives the shortest round-trip digits, as Python's repr
    // does: `d.ddddde-5`. Where two strings of that length round-trip at the
    // same distance from `v`, Python takes the even one and Rust the upper
    // one; Rust's exact formatting at that length rounds ties to even, so it
    // is Python's choice whenever it round-trips (it does but at rare
    // binade edges, where the shortest stays).
    let shortest = format!("{:e}", v.abs());
    let len = shortest.split_once('e').map_or(0, |(m, _)| m.chars().filter(char::is_ascii_digit).count());
    let nearest = format!("{:.*e}", len.saturating_sub(1), v.abs());
    let sci = if nearest.parse::<f64>().is_ok_and(|x| x == v.abs()) { nearest } else { shortest };
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if !(-4..16).contains(&exponent) {
        let (first, rest) = digits.split_at(1);
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let sign = if exponent < 0 { '-' } else { '+' };
        let _ = write!(out, "e{sign}{:02}", exponent.unsigned_abs());
    } else if exponent >= 0 {
        let int_len = exponent as usize + 1;
        if digits.len() <= int_len {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', int_len - digits.len()));
            out.push_str(".0");
        } else {
            let (int, frac) = digits.split_at(int_len);
            out.push_str(int);
            out.push('.');
            out.push_str(frac);
        }
    } else {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', exponent.unsigned_abs() as usize - 1));
        out.push_str(&digits);
    }
}

/// `v` as Python's `json.dumps` writes it.
pub fn py_float(v: f64) -> String {
    let mut out = String::new();
    write_py_float(&mut out, v);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_as_python_writes_them() {
        // Each right-hand side is Python 3's `json.dumps(x)`.
        let cases: &[(f64, &str)] = &[
            (f64::from(-0.0003f32), "-0.0003000000142492354"),
            (f64::from(-2.1e-5f32), "-2.099999983329326e-05"),
            (f64::from(-0.0071f32), "-0.0071000000461936"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1.234e300, "1.234e+300"),
            (1234567890123456.0, "1234567890123456.0"),
            (123.0, "123.0"),
            (0.5, "0.5"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (1700000000.001, "1700000000.001"),
            (412.7384520000001, "412.7384520000001"),
            // A tie between two shortest strings: Python takes the even one.
            (f64::from(-142.34097f32), "-142.34097290039062"),
            (f64::from(630.294f32), "630.2940063476562"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for &(v, want) in cases {
            assert_eq!(py_float(v), want, "{v:?}");
            if v.is_finite() {
                assert_eq!(want.parse::<f64>().map(f64::to_bits), Ok(v.to_bits()), "{want} parses back");
            }
        }
    }
}
