-- Union views for a connection over a single run: every row carries run = 'a'.

-- Records of every run of the connection, labelled by run.
-- @column run      Which run the row comes from: 'a' (or 'b').
CREATE VIEW records AS
SELECT 'a' AS run, * FROM a_records;

-- Metrics of every run of the connection, labelled by run.
-- @column run      Which run the row comes from: 'a' (or 'b').
CREATE VIEW metrics AS
SELECT 'a' AS run, * FROM a_metrics;

-- Events of every run of the connection, labelled by run.
-- @column run      Which run the row comes from: 'a' (or 'b').
CREATE VIEW events AS
SELECT 'a' AS run, * FROM a_events;
