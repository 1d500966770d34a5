//! Times as people read them: a moment as a UTC date and time, not milliseconds since the Unix
//! epoch (what the state file and the status messages carry).

/// Milliseconds since 1970-01-01 UTC now (0 on a clock before it).
pub fn unix_ms_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// `unix_ms` (milliseconds since 1970-01-01 UTC) as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc_text(unix_ms: u64) -> String {
    let ((y, m, d), (h, min, s)) = utc_parts(unix_ms);
    format!("{y:04}-{m:02}-{d:02} {h:02}:{min:02}:{s:02} UTC")
}

/// `unix_ms` as a name that sorts as the moments do, `20261129-075812` (UTC): a run directory's.
pub fn utc_stamp(unix_ms: u64) -> String {
    let ((y, m, d), (h, min, s)) = utc_parts(unix_ms);
    format!("{y:04}{m:02}{d:02}-{h:02}{min:02}{s:02}")
}

/// The UTC date and time of day of `unix_ms`.
fn utc_parts(unix_ms: u64) -> ((i64, u32, u32), (u64, u64, u64)) {
    let secs = unix_ms / 1000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    (civil_from_days(days), (rem / 3600, rem % 3600 / 60, rem % 60))
}

/// The proleptic Gregorian date of day `days` since 1970-01-01 (H. Hinnant's `civil_from_days`:
/// 400-year eras of 146,097 days, years starting in March so that the leap day is the last).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = (if mp < 10 { mp + 3 } else { mp - 9 }) as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dates Python's `datetime.utcfromtimestamp` gives for the same instants: the epoch, a leap
    /// day of a year divisible by 400, a day of this decade, and the last of February in 2100
    /// (not a leap year).
    #[test]
    fn instants_read_as_their_dates() {
        for (ms, want) in [
            (0, "1970-01-01 00:00:00 UTC"),
            (951_782_400_000, "2000-02-29 00:00:00 UTC"),
            (1_795_903_524_999, "2026-11-28 22:05:24 UTC"),
            (4_107_542_399_000, "2100-02-28 23:59:59 UTC"),
        ] {
            assert_eq!(utc_text(ms), want);
        }
        assert_eq!(utc_stamp(1_795_903_524_999), "20261128-220524");
    }

    /// Day after day, the dates count up by one: month and year ends roll over, never skip, and
    /// February has its 29th in leap years only.
    #[test]
    fn consecutive_days_are_consecutive_dates() {
        let mut prev = civil_from_days(-1);
        for day in 0..200_000 {
            let (y, m, d) = civil_from_days(day);
            let next_of_prev = d == prev.2 + 1 && m == prev.1 && y == prev.0;
            let new_month = d == 1 && ((m == prev.1 + 1 && y == prev.0) || (m == 1 && prev.1 == 12 && y == prev.0 + 1));
            assert!(next_of_prev || new_month, "day {day}: {prev:?} then {:?}", (y, m, d));
            assert!((28..=31).contains(&prev.2) || !new_month);
            let leap = y % 4 == 0 && (y % 100 != 0 || y % 400 == 0);
            assert!(!(m == 2 && d == 29) || leap, "{y}-02-29");
            assert!(!(m == 3 && d == 1) || prev.2 == if leap { 29 } else { 28 }, "{y}: February ends on {}", prev.2);
            prev = (y, m, d);
        }
    }
}
