/*
 * Drag-and-drop upload for memlens: each file is sent as the raw body of POST /upload (no
 * base64), with a progress bar from XHR upload events. When the server answers, the result is
 * handed to Dash through dash_clientside.set_props on the "upload-event" store, which the
 * Python callbacks listen to. Dash renders the page after this script runs, so all listeners
 * are delegated from the document.
 *
 * The server gives each browser session a share of its workers (data-parallel-uploads on the
 * drop zone): a drop of many files (the ranks of a job) is sent that many at a time, the rest
 * waiting in the page, rather than all at once and the excess answered "busy".
 */
(function () {
  "use strict";

  var nonce = 0;
  var waiting = [];
  var sending = 0;

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

  function finish(ui, ok, text) {
    ui.status.textContent = text;
    ui.bar.value = ok ? 100 : 0;
    ui.row.className = "upload-row " + (ok ? "upload-ok" : "upload-failed");
    if (ok) {
      setTimeout(function () { if (ui.row.parentNode) { ui.row.parentNode.removeChild(ui.row); } }, 4000);
    }
  }

  function sendNext() {
    while (sending < parallelUploads() && waiting.length > 0) {
      var next = waiting.shift();
      sending += 1;
      send(next.file, next.ui, function () { sending -= 1; sendNext(); });
    }
  }

  function upload(file) {
    var ui = progressRow(file.name);
    if (file.size > limitBytes()) {
      var message = file.name + " is " + human(file.size) + ", over this server's upload limit (" +
        human(limitBytes()) + "): open it with `memlens serve FILE` or raise --max-upload";
      finish(ui, false, "too large");
      notify({ error: message, name: file.name });
      return;
    }
    waiting.push({ file: file, ui: ui });
    sendNext();
  }

  function send(file, ui, done) {
    var xhr = new XMLHttpRequest();
    xhr.open("POST", "upload?name=" + encodeURIComponent(file.name));
    xhr.setRequestHeader("Content-Type", "application/octet-stream");
    xhr.upload.onprogress = function (event) {
      if (event.lengthComputable) {
        ui.bar.value = Math.round((100 * event.loaded) / event.total);
        ui.status.textContent = human(event.loaded) + " / " + human(event.total);
      }
    };
    xhr.upload.onload = function () {
      ui.bar.removeAttribute("value");  // indeterminate while the server analyses
      ui.status.textContent = "analysing…";
    };
    xhr.onloadend = done;
    xhr.onload = function () {
      var body = {};
      try { body = JSON.parse(xhr.responseText); } catch (e) { body = {}; }
      if (xhr.status === 200 && body.id) {
        finish(ui, true, "done");
        notify({ id: body.id, name: body.name });
      } else {
        var error = body.error || (file.name + ": upload failed (HTTP " + xhr.status + ")");
        finish(ui, false, "failed");
        notify({ error: error, name: file.name });
      }
    };
    xhr.onerror = function () {
      finish(ui, false, "failed");
      notify({ error: file.name + ": the upload was interrupted (is the server still running?)", name: file.name });
    };
    xhr.send(file);
  }

  function uploadAll(files) {
    for (var i = 0; i < files.length; i += 1) { upload(files[i]); }
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
    if (event.dataTransfer && event.dataTransfer.files) { uploadAll(event.dataTransfer.files); }
  });
  document.addEventListener("change", function (event) {
    var target = event.target;
    if (target && target.id === "file-input" && target.files) {
      uploadAll(target.files);
      target.value = "";
    }
  });
  document.addEventListener("click", function (event) {
    var z = inZone(event.target);
    if (z && event.target.id !== "file-input") {
      var input = document.getElementById("file-input");
      if (input) { input.click(); }
    }
  });
})();
