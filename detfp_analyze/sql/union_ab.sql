-- Union views for a connection over two runs: rows of A then B, labelled by run.

-- Records of both runs, labelled by run.
-- @column run      Which run the row comes from: 'a' or 'b'.
CREATE VIEW records AS
SELECT 'a' AS run, * FROM a_records
UNION ALL BY NAME
SELECT 'b' AS run, * FROM b_records;

-- Metrics of both runs, labelled by run.
-- @column run      Which run the row comes from: 'a' or 'b'.
CREATE VIEW metrics AS
SELECT 'a' AS run, * FROM a_metrics
UNION ALL BY NAME
SELECT 'b' AS run, * FROM b_metrics;

-- Events of both runs, labelled by run.
-- @column run      Which run the row comes from: 'a' or 'b'.
CREATE VIEW events AS
SELECT 'a' AS run, * FROM a_events
UNION ALL BY NAME
SELECT 'b' AS run, * FROM b_events;
