/*
 * Drag-and-drop upload for memlens: each file is sent as the raw body of POST /upload (no
 * base64), with a progress bar from XHR upload events (the bytes sent), then the analysis' stages
 * (GET upload/progress, by the ticket the upload was sent with). When the server answers, the result is
 * handed to Dash through dash_clientside.set_props on the "upload-event" store, which the
 * Python callbacks listen to. Dash renders the page after this script runs, so all listeners
 * are delegated from the document.
 *
 * The server gives each browser session a share of its workers (data-parallel-uploads on the
 * drop zone): a drop of many files (the ranks of a job) is sent that many at a time, the rest
 * waiting in the page, rather than all at once and the excess answered "busy".
 *
 * A recorded run is a snapshot and its sidecar (run.pickle, run.memlens.json): in one drop (or
 * one choice, or a folder) the sidecars are sent first and the snapshots once they are answered,
 * so each snapshot is analysed once, with its sidecar. A dropped folder is walked (its files'
 * folder goes with each upload: a sidecar pairs with the snapshot of its own folder); a .zip of a
 * run folder is unpacked by the server. Every row of the upload list ends with the server's one
 * line: "analysed with run.memlens.json", or why a file could not be used.
 */
(function () {
  "use strict";

  var nonce = 0;
  var waiting = [];
  var sending = 0;
  var keptRows = {};  // folder/name of a sidecar kept for its snapshot -> its row, told when they pair
  var PROGRESS_POLL_MS = 300;  // how often an upload's row asks how far its analysis has got

  function zone() { return document.getElementById("dropzone"); }

  function limitBytes() {
    var el = zone();
    var value = el ? Number(el.getAttribute("data-max-upload")) : NaN;
    return isFinite(value) && value > 0 ? value : Infinity;
  }

  function parallelUploads() {
    var el = zone();
    var value = el ? Number(el.getAttribute("data-parallel-uploads")) : NaN;
    return isFinite(value) && value >= 1 ? value : 1;
  }

  function human(bytes) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var i = 0;
    while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; i += 1; }
    return (i === 0 ? bytes : bytes.toFixed(1)) + " " + units[i];
  }

  function notify(result) {
    nonce += 1;
    result.nonce = nonce;
    if (window.dash_clientside && window.dash_clientside.set_props) {
      window.dash_clientside.set_props("upload-event", { data: result });
    }
  }

  function progressRow(name) {
    var list = document.getElementById("upload-progress");
    var row = document.createElement("div");
    row.className = "upload-row";
    var label = document.createElement("span");
    label.className = "upload-name";
    label.textContent = name;
    var bar = document.createElement("progress");
    bar.max = 100;
    bar.value = 0;
    var status = document.createElement("span");
    status.className = "upload-status";
    status.textContent = "waiting";
    row.appendChild(label);
    row.appendChild(bar);
    row.appendChild(status);
    if (list) { list.appendChild(row); }
    return { row: row, bar: bar, status: status };
  }

  // ok: the file was used; a row with a note (what the server said of it) stays to be read.
  function finish(ui, ok, text, note) {
    ui.status.textContent = text;
    ui.bar.value = ok ? 100 : 0;
    ui.row.className = "upload-row " + (ok ? "upload-ok" : "upload-failed") + (note ? " upload-note" : "");
    if (ok && !note) {
      setTimeout(function () { if (ui.row.parentNode) { ui.row.parentNode.removeChild(ui.row); } }, 4000);
    }
  }

  function sendNext() {
    while (sending < parallelUploads() && waiting.length > 0) {
      var next = waiting.shift();
      sending += 1;
      send(next.item, next.ui, (function (item) {
        return function () { sending -= 1; if (item.done) { item.done(); } sendNext(); };
      })(next.item));
    }
  }

  function isSidecar(name) { return /\.json$/i.test(name); }

  function folderOf(path) {
    var cut = (path || "").lastIndexOf("/");
    return cut > 0 ? path.slice(0, cut) : "";
  }

  // item: {file, folder, done}: done (optional) is called once the server has answered.
  function upload(item) {
    var file = item.file;
    var ui = progressRow((item.folder ? item.folder + "/" : "") + file.name);
    var limit = isSidecar(file.name) ? Infinity : limitBytes();  // the server says why a sidecar is too large
    if (file.size > limit) {
      var message = file.name + " is " + human(file.size) + ", over this server's upload limit (" +
        human(limitBytes()) + "): open it with `memlens serve FILE` or raise --max-upload";
      finish(ui, false, message);
      notify({ error: message, name: file.name });
      if (item.done) { item.done(); }
      return;
    }
    waiting.push({ item: item, ui: ui });
    sendNext();
  }

  function fileRows(files) {
    for (var i = 0; i < files.length; i += 1) {
      var entry = files[i];
      var ui = progressRow("  " + entry.name);
      var ok = !entry.error;
      finish(ui, ok, entry.error || entry.note || "done", true);
    }
  }

  // A name for one upload, that the page follows its analysis by (GET upload/progress).
  function newTicket() {
    var bytes = new Uint8Array(12);
    window.crypto.getRandomValues(bytes);
    return Array.prototype.map.call(bytes, function (b) { return ("0" + b.toString(16)).slice(-2); }).join("");
  }

  // Once the bytes are sent: the analysis' stages (the terminal's) in the row, until the answer.
  function followAnalysis(ticket, ui, xhr) {
    function poll() {
      if (xhr.readyState === 4) { return; }
      var probe = new XMLHttpRequest();
      probe.open("GET", "upload/progress?ticket=" + ticket);
      probe.onload = function () {
        if (xhr.readyState === 4) { return; }
        if (probe.status === 200) {
          var state = {};
          try { state = JSON.parse(probe.responseText); } catch (e) { state = {}; }
          if (state.stage && !state.finished) {
            ui.bar.value = Math.round(100 * (state.fraction || 0));
            ui.status.textContent = "analysing: " + (state.stage === "queued" ? "waiting for a worker" : state.stage) +
              " " + Math.round(100 * (state.fraction || 0)) + "%";
            ui.row.setAttribute("data-stage", state.stage);
          }
        }
        setTimeout(poll, PROGRESS_POLL_MS);
      };
      probe.onerror = function () { setTimeout(poll, PROGRESS_POLL_MS); };
      probe.send();
    }
    poll();
  }

  function send(item, ui, done) {
    var file = item.file;
    var xhr = new XMLHttpRequest();
    var ticket = newTicket();
    // The body is the File itself: the browser streams it from disk (never read into the page),
    // so a 1 GB upload holds no memory here and the page stays responsive while it goes.
    xhr.open("POST", "upload?name=" + encodeURIComponent(file.name) + "&ticket=" + ticket +
      (item.folder ? "&folder=" + encodeURIComponent(item.folder) : ""));
    xhr.setRequestHeader("Content-Type", "application/octet-stream");
    xhr.upload.onprogress = function (event) {
      if (event.lengthComputable) {
        ui.bar.value = Math.round((100 * event.loaded) / event.total);
        ui.status.textContent = human(event.loaded) + " / " + human(event.total);
      }
    };
    xhr.upload.onload = function () {
      ui.bar.removeAttribute("value");  // indeterminate until the server says how far it has got
      ui.status.textContent = "analysing…";
      if (!isSidecar(file.name)) { followAnalysis(ticket, ui, xhr); }
    };
    xhr.onloadend = done;
    xhr.onload = function () {
      var body = {};
      try { body = JSON.parse(xhr.responseText); } catch (e) { body = {}; }
      if (xhr.status === 200 && (body.id || body.note)) {
        finish(ui, true, body.note || "done", !!body.note);
        var key = (item.folder || "") + "/" + (body.sidecar || "");
        if (body.sidecar && !body.id) { keptRows[key] = ui; }
        if (body.sidecar && body.id && keptRows[key] && keptRows[key] !== ui) {
          finish(keptRows[key], true, "paired with " + body.name, true);
          delete keptRows[key];
        }
        if (body.files) { fileRows(body.files); }
        notify(body.id ? { id: body.id, name: body.name, note: body.note } : { note: body.note, name: body.name });
      } else {
        var error = body.error || (file.name + ": upload failed (HTTP " + xhr.status + ")");
        finish(ui, false, error);
        notify({ error: error, name: file.name });
      }
    };
    xhr.onerror = function () {
      var error = file.name + ": the upload was interrupted (is the server still running?)";
      finish(ui, false, error);
      notify({ error: error, name: file.name });
    };
    xhr.send(file);
  }

  // items: [{file, folder}] of one drop or choice: the sidecars first, the rest once they are answered.
  function uploadItems(items) {
    var sidecars = items.filter(function (item) { return isSidecar(item.file.name); });
    var rest = items.filter(function (item) { return !isSidecar(item.file.name); });
    var left = sidecars.length;
    function release() { for (var i = 0; i < rest.length; i += 1) { upload(rest[i]); } }
    if (left === 0) { release(); return; }
    sidecars.forEach(function (item) {
      item.done = function () { left -= 1; if (left === 0) { release(); } };
      upload(item);
    });
  }

  function uploadAll(files) {
    var items = [];
    for (var i = 0; i < files.length; i += 1) {
      items.push({ file: files[i], folder: folderOf(files[i].webkitRelativePath) });
    }
    uploadItems(items);
  }

  // A dropped folder: its files, walked to MAX_DEPTH folders and MAX_FILES files.
  var MAX_DEPTH = 8;
  var MAX_FILES = 1000;

  function walkEntries(entries, done) {
    var items = [];
    var pending = 0;
    function finishOne() { pending -= 1; if (pending === 0) { done(items); } }
    function visit(entry, depth) {
      if (items.length >= MAX_FILES) { return; }
      if (entry.isFile) {
        pending += 1;
        entry.file(function (file) {
          items.push({ file: file, folder: folderOf(entry.fullPath.replace(/^\//, "")) });
          finishOne();
        }, finishOne);
      } else if (entry.isDirectory && depth < MAX_DEPTH) {
        pending += 1;
        var reader = entry.createReader();
        var readBatch = function () {
          reader.readEntries(function (batch) {
            if (batch.length === 0) { finishOne(); return; }
            for (var i = 0; i < batch.length; i += 1) { visit(batch[i], depth + 1); }
            readBatch();  // readEntries answers in batches of at most 100
          }, finishOne);
        };
        readBatch();
      }
    }
    pending += 1;
    for (var i = 0; i < entries.length; i += 1) { visit(entries[i], 0); }
    finishOne();
  }

  function dropped(transfer) {
    var entries = [];
    if (transfer.items) {
      for (var i = 0; i < transfer.items.length; i += 1) {
        var item = transfer.items[i];
        var entry = item.webkitGetAsEntry ? item.webkitGetAsEntry() : null;
        if (entry) { entries.push(entry); }
      }
    }
    if (entries.length > 0) { walkEntries(entries, uploadItems); return; }
    if (transfer.files) { uploadAll(transfer.files); }
  }

  // dcc.Input has no type="file": the chooser is a plain input owned by this script. It stays
  // in the layout (transparent, 1 px) rather than display:none so automation can fill it.
  function ensureInput() {
    if (document.getElementById("file-input")) { return; }
    var input = document.createElement("input");
    input.type = "file";
    input.id = "file-input";
    input.multiple = true;
    input.className = "file-input";
    input.setAttribute("aria-label", "choose snapshot files");
    document.body.appendChild(input);
    var folder = document.createElement("input");
    folder.type = "file";
    folder.id = "folder-input";
    folder.multiple = true;
    folder.webkitdirectory = true;
    folder.className = "file-input";
    folder.setAttribute("aria-label", "choose a run folder");
    document.body.appendChild(folder);
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", ensureInput);
  } else {
    ensureInput();
  }

  function inZone(target) { return target && target.closest && target.closest("#dropzone"); }

  document.addEventListener("dragover", function (event) {
    if (inZone(event.target)) {
      event.preventDefault();
      zone().classList.add("dragging");
    }
  });
  document.addEventListener("dragleave", function (event) {
    if (inZone(event.target)) { zone().classList.remove("dragging"); }
  });
  document.addEventListener("drop", function (event) {
    if (!inZone(event.target)) { return; }
    event.preventDefault();
    zone().classList.remove("dragging");
    if (event.dataTransfer) { dropped(event.dataTransfer); }
  });
  document.addEventListener("change", function (event) {
    var target = event.target;
    if (target && (target.id === "file-input" || target.id === "folder-input") && target.files) {
      uploadAll(target.files);
      target.value = "";
    }
  });
  document.addEventListener("click", function (event) {
    var z = inZone(event.target);
    if (z && event.target.id !== "file-input" && event.target.id !== "folder-input") {
      var wantsFolder = event.target.closest && event.target.closest("#choose-folder");
      var input = document.getElementById(wantsFolder ? "folder-input" : "file-input");
      if (input) { input.click(); }
    }
  });
})();
