//! Calendar time in UTC from Unix time, for the formats that need a date (RFC
//! 3339 in events, the dates of an AWS request signature) without a time crate.

/// A UTC calendar date and time of day, to the second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UtcTime {
    pub year: i64,
    pub month: u32,
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
}

impl UtcTime {
    /// The calendar time of `secs` seconds after the Unix epoch (negative is before).
    pub fn from_unix_seconds(secs: i64) -> UtcTime {
        let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        // Civil from days (Howard Hinnant's algorithm).
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        UtcTime {
            year: yoe + era * 400 + i64::from(month <= 2),
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem % 3600 / 60) as u32,
            second: (rem % 60) as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::UtcTime;

    #[test]
    fn calendar_dates_from_unix_seconds() {
        let t = |y, mo, d, h, mi, s| UtcTime {
            year: y,
            month: mo,
            day: d,
            hour: h,
            minute: mi,
            second: s,
        };
        assert_eq!(UtcTime::from_unix_seconds(0), t(1970, 1, 1, 0, 0, 0));
        // 2015-08-30T12:36:00Z, the date of AWS's signature examples.
        assert_eq!(
            UtcTime::from_unix_seconds(1_440_938_160),
            t(2015, 8, 30, 12, 36, 0)
        );
        // A leap day, and the day before the epoch.
        assert_eq!(
            UtcTime::from_unix_seconds(951_782_400),
            t(2000, 2, 29, 0, 0, 0)
        );
        assert_eq!(UtcTime::from_unix_seconds(-1), t(1969, 12, 31, 23, 59, 59));
    }
}
